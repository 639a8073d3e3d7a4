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
