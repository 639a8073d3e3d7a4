//! Fencing: parsing the `X-Fencing-Token` header, the in-memory fence
//! table, and the activation barrier.
//!
//! The table is the only thing the data path consults. A durable write
//! happens only when a fence moves (a grant, or an external token), and it
//! is submitted while the key's slot is locked so that durable order per
//! key equals in-memory order.

mod table;
pub mod token;

pub(crate) use table::LeaseSlot;
pub use table::{
    Admission, BarrierOutcome, CheckPolicy, FenceTable, InflightCtl, InflightGuard, Refusal, TableFootprint,
};
pub use token::parse_token_header;

/// A resource key as the lease and fence maps hold it: one pointer to a
/// shared block (counts, length, bytes), where an `Arc<str>` takes two —
/// 8 bytes less per bucket of each map and per expiry entry.
pub type Key = arcstr::ArcStr;

/// Whether the grant behind `token` is live now: what a strict route asks
/// before it admits a token equal to the fence. Answered by the authority
/// that issued the grant (the embedded one, or the cluster's mirror of
/// etcd), the one place a grant's state is kept: the fence table keeps no
/// copy of it, so a grant whose deadline has passed is refused at once,
/// however far behind the work of ending grants is.
pub trait GrantLiveness: Send + Sync {
    /// Whether `key`'s current grant has `token` and has not ended.
    fn liveness(&self, key: &str, token: u64) -> Liveness;
}

/// What an authority knows of a grant's state ([`GrantLiveness`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// The grant has the token and has not ended.
    Live,
    /// The grant has ended, or the key's grant has another token.
    Ended,
    /// Cluster mode: the grant is still in this gateway's view, but this
    /// gateway's deadline for it has passed and it has seen neither a
    /// renewal nor the grant's end: either may still be on its way. Refused
    /// as `not_current` (retry), not `lease_expired` (the holder lost it).
    Unsure(&'static str),
}

impl From<bool> for Liveness {
    /// `Live` or `Ended`, for an authority that is never unsure.
    fn from(live: bool) -> Liveness {
        if live {
            Liveness::Live
        } else {
            Liveness::Ended
        }
    }
}
