//! `SqliteStore`, on a database file of the test's own.

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};

use super::{lease, schema, unique};
use crate::store::SqliteStore;

/// A pool on a new WAL database file, and the file, removed by [`remove`].
async fn fresh(max_connections: u32) -> (SqlitePool, std::path::PathBuf) {
    let path = std::env::temp_dir().join(format!("{}.db", unique("axum_idempotency")));
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal);
    let pool = SqlitePoolOptions::new()
        .max_connections(max_connections)
        .connect_with(options)
        .await
        .unwrap();
    (pool, path)
}

/// Closes `pool` and removes its database file with the WAL files beside it.
async fn remove(pool: SqlitePool, path: std::path::PathBuf) {
    pool.close().await;
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.clone().into_os_string();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn expired_lease_is_taken_over_only_after_asking_recovery() {
    let (pool, path) = fresh(16).await;
    let store = SqliteStore::new(pool.clone());
    store.migrate().await.unwrap();
    lease::expired_lease_is_taken_over_only_after_asking_recovery(store).await;
    remove(pool, path).await;
}

#[tokio::test]
async fn an_unmigrated_store_names_the_fix_until_migrated() {
    let (pool, path) = fresh(2).await;
    schema::an_unmigrated_store_names_the_fix_until_migrated(SqliteStore::new(pool.clone()), 1)
        .await;
    remove(pool, path).await;
}

#[tokio::test]
async fn an_outdated_schema_is_reported_until_it_is_current() {
    let (pool, path) = fresh(2).await;
    schema::an_outdated_schema_is_reported_until_it_is_current(SqliteStore::new(pool.clone()), 1)
        .await;
    remove(pool, path).await;
}

#[tokio::test]
async fn a_record_too_large_to_write_out_is_claimed_with_bound_values() {
    let (pool, path) = fresh(2).await;
    let store = SqliteStore::new(pool.clone());
    store.migrate().await.unwrap();
    super::large::a_record_too_large_to_write_out_is_claimed_with_bound_values(store).await;
    remove(pool, path).await;
}

/// The rows the pool's one connection has written since it opened.
async fn changes(pool: &SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT total_changes()")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_new_keys_record_is_written_once_with_commit_and_the_connection_stays_consistent() {
    use std::time::Duration;

    use super::{completed, finished, now_ms, protocol_of, record, scope};
    use crate::record::RecordState;

    let (pool, path) = fresh(1).await;
    let store = SqliteStore::new(pool.clone());
    store.migrate().await.unwrap();
    let protocol = protocol_of(&store);
    let wait = Duration::from_secs(1);
    let key = scope("k-sqlite-fused");
    let now = now_ms();
    let claim = record(&key, "a", RecordState::Processing, None, now, 60_000);

    let before = changes(&pool).await;
    let mut tx = protocol.begin(wait).await.unwrap();
    assert!(protocol.claim(&mut tx, &claim, wait).await.unwrap());
    protocol
        .commit_record(tx, &finished(&claim, &completed("one")))
        .await
        .unwrap();
    assert_eq!(changes(&pool).await - before, 1, "one row written, once");

    let duplicate = record(&key, "b", RecordState::Processing, None, now + 1, 60_000);
    let mut tx = protocol.begin(wait).await.unwrap();
    assert!(!protocol.claim(&mut tx, &duplicate, wait).await.unwrap());
    drop(tx);
    let found = protocol.lookup(&key.scoped_key()).await.unwrap().unwrap();
    assert_eq!(found.response.unwrap().body.as_ref(), b"one");

    // The commit left sqlx counting no transaction the connection is not in: a write in a
    // transaction rolled back is gone.
    sqlx::raw_sql("CREATE TABLE work (id INTEGER)")
        .execute(&pool)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO work VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let work: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM work")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(work, 0);
    remove(pool, path).await;
}
