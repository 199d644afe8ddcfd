//! `MySqlStore` claims a key in the message that begins the transaction, with the values
//! written into the SQL text: hostile principals, routes and methods are stored byte for byte
//! and run no statement of their own, and a claim that loses leaves the pooled connection
//! outside any transaction with its own lock-wait bound.
//!
//! Each test works in a database of its own on the server at `TEST_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/test`).
#![cfg(feature = "mysql")]

use std::sync::atomic::{AtomicUsize, Ordering};

use axum_idempotency::{Engine, Fingerprinter, IdempotencyKey, MySqlStore, Outcome, Scope, Tx};
use proptest::prelude::*;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{MySql, MySqlPool, Row};

fn url() -> String {
    std::env::var("TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// A pool on a fresh database holding the records table and a canary table that an injected
/// statement would drop or fill; returns the database's name for [`drop_database`].
async fn fresh(connections: u32) -> (MySqlPool, MySqlStore, String) {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let name = format!(
        "one_trip_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let admin = MySqlPool::connect(&url()).await.expect("MariaDB reachable");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name}; CREATE DATABASE {name}; \
         CREATE TABLE {name}.canary (id INT PRIMARY KEY); INSERT INTO {name}.canary VALUES (1)"
    )))
    .execute(&admin)
    .await
    .expect("create database");
    admin.close().await;
    let options = url()
        .parse::<MySqlConnectOptions>()
        .expect("url")
        .database(&name);
    let pool = MySqlPoolOptions::new()
        .max_connections(connections)
        .connect_with(options)
        .await
        .expect("pool");
    let store = MySqlStore::new(pool.clone());
    store.migrate().await.expect("migrate");
    (pool, store, name)
}

async fn drop_database(pool: MySqlPool, name: &str) {
    pool.close().await;
    let admin = MySqlPool::connect(&url()).await.expect("MariaDB reachable");
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {name}")))
        .execute(&admin)
        .await;
    admin.close().await;
}

fn key(text: &str) -> IdempotencyKey {
    text.parse().expect("valid key")
}

/// Rows of the records table, whether the canary is untouched, and whether the pool's next
/// connection is outside any transaction.
async fn census(pool: &MySqlPool) -> (i64, bool, bool) {
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_records")
        .fetch_one(pool)
        .await
        .expect("count records");
    let canary: Vec<i32> = sqlx::query_scalar("SELECT id FROM canary")
        .fetch_all(pool)
        .await
        .expect("the canary table still exists");
    let in_tx: u64 = sqlx::query_scalar("SELECT @@in_transaction")
        .fetch_one(pool)
        .await
        .expect("probe");
    (records, canary == [1], in_tx == 0)
}

/// Strings built to end a quoted literal or a statement early, in every escaping convention.
fn hostile() -> impl Strategy<Value = String> {
    let pieces = prop::sample::select(vec![
        "'",
        "''",
        "\\",
        "\\'",
        "';",
        "'); DROP TABLE canary; --",
        "`",
        "\"",
        ";",
        "-- ",
        "#",
        "/*",
        "*/",
        "\u{FEFF}",
        "é",
        "😀",
        "\r\n",
        "\0",
        "?",
        "X'",
        "', X'",
        "' USING ",
        "\u{5c}\u{27}",
        "%",
        "_",
    ]);
    prop::collection::vec(
        prop_oneof![
            pieces.prop_map(str::to_owned),
            any::<String>().prop_map(|s| s.chars().take(6).collect())
        ],
        0..12,
    )
    .prop_map(|parts| parts.concat())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn sql_injection_through_a_principal_route_or_method_is_impossible_on_mysql(
        principal in hostile(),
        method in hostile(),
        route in hostile(),
    ) {
        let rt = runtime();
        let (stored, census_after) = rt.block_on(async {
            let (pool, store, name) = fresh(1).await;
            let scope = Scope::new(principal.clone(), method.clone(), route.clone(), key("k-hostile"));
            let fingerprint = Fingerprinter::new().fingerprint_value(&route, b"{}");
            let done = Engine::new(store.clone())
                .run(&scope, fingerprint, |_tx: Tx<MySql>| async { "done" })
                .await
                .expect("executed");
            assert_eq!(done.outcome, Outcome::Executed);
            // Another engine has not seen the key: its claim loses in the BEGIN message.
            let again = Engine::new(store)
                .run(&scope, fingerprint, |_tx: Tx<MySql>| async { "never" })
                .await
                .expect("replayed");
            assert_eq!(again.outcome, Outcome::Replayed);
            let stored = sqlx::query(
                "SELECT principal, method, route FROM idempotency_records WHERE key_digest = ?",
            )
            .bind(scope.scoped_key().digest().to_vec())
            .fetch_optional(&pool)
            .await
            .expect("read record")
            .map(|row| {
                let principal: Option<String> = row.get(0);
                let method: String = row.get(1);
                let route: String = row.get(2);
                (principal, method, route)
            });
            let census_after = census(&pool).await;
            drop_database(pool, &name).await;
            (stored, census_after)
        });
        prop_assert_eq!(stored, Some((Some(principal), method, route)));
        prop_assert_eq!(census_after, (1, true, true));
    }
}
