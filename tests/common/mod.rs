//! The one harness of the test binaries. Each binary takes the parts it uses, so the rest is
//! dead code there.
//!
//! - [`names`]: names for schemas, databases, queues and keys that no other test uses.
//! - [`backends`]: a fresh database per backend and a test app on it, for the conformance suite.
//! - [`process`]: the examples run as real processes, and an HTTP client to talk to them.
//! - [`galera`]: a private three-node MariaDB Galera cluster, for the cluster suite.
//! - [`lossy`]: an in-memory idempotent server behind a proxy that loses answers, for the client.

#![allow(dead_code, unreachable_pub, unused_imports)]

#[cfg(feature = "server")]
pub(crate) mod backends;
#[cfg(feature = "mysql")]
pub(crate) mod galera;
pub(crate) mod lossy;
pub(crate) mod names;
pub(crate) mod process;

#[cfg(feature = "server")]
pub(crate) use backends::*;
pub(crate) use names::unique;
