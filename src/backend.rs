//! The databases this crate keeps its tables in.

/// A database this crate keeps its tables in: `sqlx::Sqlite`, `sqlx::Postgres` and
/// `sqlx::MySql` (MySQL 8 and MariaDB), each behind the cargo feature of its name.
///
/// It is the one type parameter of the crate's generic types, as in sqlx:
/// [`Store<Postgres>`](crate::Store) (alias `PgStore`),
/// [`IdempotencyLayer<Postgres>`](crate::IdempotencyLayer), [`Engine<Postgres>`](crate::Engine)
/// and [`Tx<Postgres>`](crate::Tx). Code of your own that is generic over the backend bounds
/// its parameter with `DB: Backend`.
///
/// The trait is sealed: how each database claims a key, leases work or keeps outbox messages is
/// internal to this crate and may change in any release without a change to this trait.
#[cfg(not(feature = "outbox"))]
pub trait Backend: crate::store::Records {}

/// A database this crate keeps its tables in: `sqlx::Sqlite`, `sqlx::Postgres` and
/// `sqlx::MySql` (MySQL 8 and MariaDB), each behind the cargo feature of its name.
///
/// It is the one type parameter of the crate's generic types, as in sqlx:
/// [`Store<Postgres>`](crate::Store) (alias `PgStore`),
/// [`IdempotencyLayer<Postgres>`](crate::IdempotencyLayer), [`Engine<Postgres>`](crate::Engine),
/// [`Tx<Postgres>`](crate::Tx) and [`Outbox<Postgres>`](crate::outbox::Outbox). Code of your own
/// that is generic over the backend bounds its parameter with `DB: Backend`.
///
/// The trait is sealed: how each database claims a key, leases work or keeps outbox messages is
/// internal to this crate and may change in any release without a change to this trait.
#[cfg(feature = "outbox")]
pub trait Backend: crate::store::Records + crate::outbox::Ops {}

#[cfg(feature = "sqlite")]
impl Backend for sqlx::Sqlite {}
#[cfg(feature = "postgres")]
impl Backend for sqlx::Postgres {}
#[cfg(feature = "mysql")]
impl Backend for sqlx::MySql {}
