//! The words the dispatcher shares with the backends, which keep the outbox's table (see
//! `crate::backend`).

pub(crate) use crate::backend::{Claim, ClaimedMessage as Claimed, Lease, Settlement};
