//! Fencing: parsing the `X-Fencing-Token` header, the in-memory fence
//! table, and the activation barrier.
//!
//! The table is the only thing the data path consults. A durable write
//! happens only when a fence moves (a grant, or an external token), and it
//! is submitted while the key's slot is locked so that durable order per
//! key equals in-memory order.

mod table;
pub mod token;

pub use table::{
    Admission, BarrierOutcome, CheckPolicy, FenceTable, InflightCtl, InflightGuard, Refusal, TableFootprint,
};
pub use token::parse_token_header;

/// Whether the grant behind `token` is live now: what a strict route asks
/// before it admits a token equal to the fence. Answered by the authority
/// that issued the grant (the embedded one, or the cluster's mirror of
/// etcd), the one place a grant's state is kept: the fence table keeps no
/// copy of it, so a grant whose deadline has passed is refused at once,
/// however far behind the work of ending grants is.
pub trait GrantLiveness: Send + Sync {
    /// True when `key`'s current grant has `token` and has not ended.
    fn is_live(&self, key: &str, token: u64) -> bool;
}
