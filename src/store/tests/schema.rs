//! A store whose tables were never migrated, or are older than the code, says so at once and
//! names the fix, rather than failing every claim as if the database were briefly down: the
//! same test on every backend.

use std::time::Duration;

use super::{now_ms, protocol_of, record, scope};
use crate::Backend;
use crate::backend::Claimed;
use crate::error::Error;
use crate::record::RecordState;
use crate::store::Store;

fn assert_outdated<T: std::fmt::Debug>(outcome: Result<T, Error>, found: i64, expected: i64) {
    match outcome {
        Err(error @ Error::SchemaOutdated { .. }) => {
            assert!(
                matches!(error, Error::SchemaOutdated { found: f, expected: e } if f == found && e == expected),
                "{error:?}"
            );
            assert!(
                error.to_string().contains("call Store::migrate()"),
                "the error names the fix: {error}"
            );
        }
        other => panic!("expected the schema to be reported outdated, got {other:?}"),
    }
}

/// `store` is on a database its migrations never ran on; `expected` is the version they end at.
pub(super) async fn an_unmigrated_store_names_the_fix_until_migrated<DB: Backend>(
    store: Store<DB>,
    expected: i64,
) {
    let protocol = protocol_of(&store);
    let scope = scope("k-unmigrated");
    let key = scope.scoped_key();
    let claim = record(&scope, "a", RecordState::Processing, None, now_ms(), 60_000);
    let wait = Duration::from_secs(1);

    assert_outdated(protocol.lookup(&key).await, 0, expected);
    assert_outdated(protocol.claimed(&claim, wait).await, 0, expected);
    assert_outdated(
        protocol.open(&key, claim.created_at, wait).await,
        0,
        expected,
    );

    store.migrate().await.expect("migrate");
    assert!(protocol.lookup(&key).await.expect("lookup").is_none());
    let Claimed::Ours(tx) = protocol.claimed(&claim, wait).await.expect("claim") else {
        panic!("a fresh key is taken");
    };
    protocol.commit_record(tx, &claim).await.expect("commit");
    assert!(protocol.lookup(&key).await.expect("lookup").is_some());
}

/// `store` is migrated; a store on the same database that finds the newest version unrecorded
/// reports the one before it, and works once the version is back, without a restart.
pub(super) async fn an_outdated_schema_is_reported_until_it_is_current<DB: Backend>(
    store: Store<DB>,
    expected: i64,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    store.migrate().await.expect("migrate");
    let versions = |sql: String| sqlx::raw_sql(sqlx::AssertSqlSafe(sql));
    versions(format!(
        "DELETE FROM idempotency_schema_versions WHERE version = {expected}"
    ))
    .execute(store.pool())
    .await
    .expect("forget the newest version");

    let older = protocol_of(&Store::new(store.pool().clone()));
    let key = scope("k-outdated").scoped_key();
    assert_outdated(older.lookup(&key).await, expected - 1, expected);

    versions(format!(
        "INSERT INTO idempotency_schema_versions (version, applied_at) VALUES ({expected}, 0)"
    ))
    .execute(store.pool())
    .await
    .expect("record the newest version again");
    assert!(older.lookup(&key).await.expect("lookup").is_none());
}
