//! The SQL of each database, behind one sealed trait the outbox and the dispatcher are generic
//! over. Adding a database means one file here implementing [`Ops`] and one `impl Backend`.

use std::future::Future;

use sqlx::{ColumnIndex, Decode, Pool, Row, Type};

use super::status::from_millis;
use super::{DownstreamKey, Message, MessageId, Record, Status};

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// A database the outbox can live in: [`sqlx::Sqlite`], [`sqlx::Postgres`] and [`sqlx::MySql`],
/// each behind the cargo feature of the same name.
///
/// The trait is sealed: its methods are the SQL of one backend and not an extension point.
pub trait Backend: sqlx::Database + private::Ops {}

pub(crate) use private::{Claim, Settlement};

mod private {
    use super::*;

    /// A claim: every due, unleased message up to `limit` gets `token` and a lease until
    /// `lease_until`, so no other dispatcher takes it before then.
    #[allow(unreachable_pub)]
    #[derive(Debug, Clone, Copy)]
    pub struct Claim {
        pub now: i64,
        pub lease_until: i64,
        pub token: i64,
        pub limit: i64,
    }

    /// The columns an attempt's outcome writes; the lease is always released with it.
    #[allow(unreachable_pub)]
    #[derive(Debug, Clone)]
    pub struct Settlement {
        pub status: Status,
        pub receipt: Option<String>,
        pub last_error: Option<String>,
        pub outcome_unknown: bool,
        pub next_attempt_at: i64,
        pub finished_at: Option<i64>,
    }

    // `pub` inside a private module is the sealed-trait idiom: `Backend` can name it as a
    // supertrait while no one outside the crate can implement or call it.
    #[allow(unreachable_pub)]
    pub trait Ops: sqlx::Database {
        /// Creates the table and its index if missing; safe when run by two instances at once.
        fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

        /// Inserts a pending message; `None` when its downstream key is already present.
        fn insert(
            conn: &mut Self::Connection,
            message: &Message,
            now: i64,
        ) -> impl Future<Output = Result<Option<MessageId>, sqlx::Error>> + Send;

        /// Reads one message by id.
        fn fetch_by_id(
            conn: &mut Self::Connection,
            id: MessageId,
        ) -> impl Future<Output = Result<Option<Record>, sqlx::Error>> + Send;

        /// Reads one message by downstream key.
        fn fetch_by_key(
            conn: &mut Self::Connection,
            key: &DownstreamKey,
        ) -> impl Future<Output = Result<Option<Record>, sqlx::Error>> + Send;

        /// Leases due messages, skipping those another dispatcher holds.
        fn claim(
            pool: &Pool<Self>,
            claim: Claim,
        ) -> impl Future<Output = Result<Vec<Record>, sqlx::Error>> + Send;

        /// Records that the sender is about to be called: one more attempt, outcome unknown
        /// until settled, so a crash during the call leads to a lookup, not a blind resend.
        /// `false` when the lease was lost to another dispatcher.
        fn begin_attempt(
            pool: &Pool<Self>,
            id: MessageId,
            token: i64,
            now: i64,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

        /// Writes an outcome and releases the lease; `false` when the lease was lost.
        fn settle(
            pool: &Pool<Self>,
            id: MessageId,
            token: i64,
            settlement: &Settlement,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
    }
}

/// Every backend selects the same columns under the same names, so one decoder serves them all.
fn record_from_row<'r, R>(row: &'r R) -> Result<Record, sqlx::Error>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    let status: String = row.try_get("status")?;
    let status = Status::parse(&status).ok_or_else(|| sqlx::Error::ColumnDecode {
        index: "status".into(),
        source: format!("unknown outbox status {status:?}").into(),
    })?;
    let attempts: i64 = row.try_get("attempts")?;
    Ok(Record {
        id: MessageId::from(row.try_get::<i64, _>("id")?),
        topic: row.try_get("topic")?,
        downstream_key: DownstreamKey::from_stored(row.try_get("downstream_key")?),
        payload: row.try_get("payload")?,
        status,
        attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
        outcome_unknown: row.try_get("outcome_unknown")?,
        receipt: row.try_get("receipt")?,
        last_error: row.try_get("last_error")?,
        created_at: from_millis(row.try_get("created_at")?),
        next_attempt_at: from_millis(row.try_get("next_attempt_at")?),
        last_attempt_at: row
            .try_get::<Option<i64>, _>("last_attempt_at")?
            .map(from_millis),
        finished_at: row
            .try_get::<Option<i64>, _>("finished_at")?
            .map(from_millis),
    })
}
