//! Deliberately broken variants of the gateway, for the nemesis harness's
//! self-tests only: a harness that cannot catch a broken gateway proves
//! nothing, so it must be shown one (nemesis/README.md).
//!
//! A fault can never be on by accident in production:
//! - it exists only in debug builds (`cfg(debug_assertions)`): in a release
//!   binary [`enabled`] is `false` and the variable below is never read;
//! - in a debug build it is on only when the environment variable
//!   [`ENV`] names it exactly (no config key, no flag); the gateway then
//!   logs an error at start saying that it is broken on purpose.
//!
//! Faults (one name each, several comma-separated):
//! - `no-self-fencing`: in cluster mode the gateway never gates mutations on
//!   its membership and its watch, so it keeps admitting past its member
//!   deadline, while partitioned from etcd or stopped, on a fence view that
//!   may be stale (the property docs/cluster.md's self-fencing gives), and
//!   a strict route takes a grant in its view as live whatever its expiry
//!   deadline (the deadline is the other half of self-fencing: a gateway cut
//!   from etcd sees neither releases nor expiries).
//! - `slow-grant-answer`: in cluster mode every shared transaction with a
//!   grant or a renewal in it is answered 1 s after etcd committed it. Not
//!   unsafe, only slow: it opens the window in which a test's client hangs
//!   up while its grant exists in etcd but is not yet answered, and the one
//!   in which a renewal's answer comes late.
//! - `stale-expiry-view`: in cluster mode the gateway's feed does not apply
//!   renewals (a put of a grant key it already holds with the same create
//!   revision), so its expiry deadlines stay those of each grant's first
//!   put. Not unsafe as long as every expiry compares the grant's
//!   `mod_revision` (a renewal committed first wins): the test that the
//!   compare is there (src/cluster/expiry.rs).
//! - `no-restore-detection`: in cluster mode the gateway never proves
//!   etcd's raft index, so it never finds a restore by its raft log going
//!   back (src/cluster/raft.rs), nor records one when a new process's
//!   first read finds etcd's numbering behind its token floor (feed.rs). Unsafe after a restore: the tests of the
//!   line of defence behind it (the token floor's holds) see that one alone.

/// The environment variable that names the faults to inject (debug builds).
pub const ENV: &str = "FENCEGATE_NEMESIS_BREAK";

/// One deliberately broken behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Cluster mode admits mutations without proving its membership.
    NoSelfFencing,
    /// Cluster mode answers each committed grant transaction 1 s late.
    SlowGrantAnswer,
    /// Cluster mode's feed ignores renewals of grants it already holds.
    StaleExpiryView,
    /// Cluster mode never compares etcd's raft index with its mark.
    NoRestoreDetection,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::NoSelfFencing => "no-self-fencing",
            Fault::SlowGrantAnswer => "slow-grant-answer",
            Fault::StaleExpiryView => "stale-expiry-view",
            Fault::NoRestoreDetection => "no-restore-detection",
        }
    }
}

/// True when `fault` is injected: never in a release build.
pub fn enabled(fault: Fault) -> bool {
    #[cfg(debug_assertions)]
    {
        std::env::var(ENV).is_ok_and(|v| named(&v, fault))
    }
    #[cfg(not(debug_assertions))]
    {
        let _ = fault;
        false
    }
}

/// True when the comma-separated list `list` names `fault` exactly.
fn named(list: &str, fault: Fault) -> bool {
    list.split(',').any(|f| f.trim() == fault.name())
}

/// Logs, once at start, every fault injected into this process.
pub fn announce() {
    for fault in [Fault::NoSelfFencing, Fault::SlowGrantAnswer, Fault::StaleExpiryView, Fault::NoRestoreDetection] {
        if enabled(fault) {
            tracing::error!(
                fault = fault.name(),
                "{ENV} injects a deliberately broken or slowed behaviour into this gateway (tests only): do not use it"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_is_named_exactly_or_not_at_all() {
        assert!(named("no-self-fencing", Fault::NoSelfFencing));
        assert!(named("other, no-self-fencing", Fault::NoSelfFencing));
        for not in ["", "no-self-fencing-please", "NO-SELF-FENCING", "1", "true", "self-fencing"] {
            assert!(!named(not, Fault::NoSelfFencing), "{not:?}");
        }
    }
}
