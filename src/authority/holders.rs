//! Holder labels, interned: every live grant with the same holder shares
//! one copy of its name (a worker holding thousands of locks stores its
//! name once), and a name is forgotten when its last grant ends. A grant
//! without a holder stores nothing. A grant keeps an `Arc<String>`: one
//! pointer (8 bytes), where an `Arc<str>` takes two.

use std::sync::Arc;

use dashmap::DashMap;

/// A holder's name as a grant keeps it.
pub(super) type Name = Arc<String>;

/// The names of the holders of live grants.
#[derive(Default)]
pub(super) struct Holders {
    names: DashMap<Box<str>, Name>,
}

impl Holders {
    /// The shared copy of `name`; `None` for the empty label.
    pub(super) fn intern(&self, name: &str) -> Option<Name> {
        if name.is_empty() {
            return None;
        }
        if let Some(known) = self.names.get(name) {
            return Some(known.value().clone());
        }
        Some(self.names.entry(Box::from(name)).or_insert_with(|| Arc::new(name.to_string())).value().clone())
    }

    /// A grant that held `name` ended: the name is forgotten if no other
    /// grant holds it. Copies of a name live only in grants and in this
    /// map, and are made only under the map's shard lock, so a count of 2
    /// (the map's and this one) under the write lock means nobody else.
    pub(super) fn release(&self, name: Option<Name>) {
        if let Some(name) = name {
            self.names.remove_if(name.as_str(), |_, v| Arc::strong_count(v) == 2);
        }
    }

    /// Bytes of the map and the names (an account, allocator rounding aside).
    pub(super) fn bytes(&self) -> usize {
        let names: usize = self.names.iter().map(|n| 2 * n.key().len() + 16 + 24).sum();
        self.names.capacity() * (std::mem::size_of::<(Box<str>, Name)>() + 1) + names
    }

    /// Distinct names of live grants.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.names.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn one_copy_per_name_forgotten_with_its_last_grant() {
        let h = Holders::default();
        assert!(h.intern("").is_none(), "no holder stores nothing");
        let a = h.intern("worker-1").unwrap();
        let b = h.intern("worker-1").unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let c = h.intern("worker-2").unwrap();
        assert_eq!(h.len(), 2);
        h.release(Some(a));
        assert_eq!(h.len(), 2, "worker-1 still holds a grant");
        h.release(Some(b));
        assert_eq!(h.len(), 1);
        h.release(Some(c));
        assert_eq!(h.len(), 0);
        h.release(None);
        // Interned again after being forgotten.
        let d = h.intern("worker-1").unwrap();
        assert_eq!(d.as_str(), "worker-1");
        assert_eq!(h.len(), 1);
    }
}
