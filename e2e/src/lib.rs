//! End-to-end runs of the real binaries: the local flash sale (`flash-sale`) and the
//! helpers the kind scripts in `e2e/kind/` share with it.
//!
//! # Layout
//!
//! - [`processes`]: starts `dropgate-operator apply` and `dropgate-sidecar` as child
//!   processes, the way a user would.
//! - [`flash_sale`]: thousands of concurrent buyers with retries, duplicate cancels
//!   and throttling; counts every answer and checks DESIGN.md's invariants.

pub mod flash_sale;
pub mod processes;
