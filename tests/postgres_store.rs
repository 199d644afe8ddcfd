//! `PgStore` against the real PostgreSQL server. How a claim waits for a concurrent claimer of
//! its key, and that it leaves the session's own `lock_timeout` to the handler, is tested where
//! the crate-private claim protocol is reachable: `src/store/tests/postgres.rs`. The layer on
//! PostgreSQL is tested by `tests/conformance.rs`.
