//! A records table filled server-side, for the `scale` section: rows that look like real
//! completed records, written by one `INSERT … SELECT` per chunk in each backend's SQL.

use tokio::runtime::Runtime;

use crate::BoxError;
use crate::order::{ORDER_BODY, TTL_MS};

type Exec = Box<dyn Fn(&Runtime, String) -> Result<u64, BoxError>>;
type PurgeFuture = std::pin::Pin<Box<dyn Future<Output = Result<u64, BoxError>> + Send>>;

/// What the scale section does to one backend's records table.
pub(crate) struct Records {
    /// Runs one SQL statement on the backend's pool; the rows it affected.
    pub(crate) exec: Exec,
    /// The store's own `purge_expired()`, to spawn while the load runs.
    pub(crate) purge: Box<dyn Fn() -> PurgeFuture>,
    pub(crate) dialect: &'static Dialect,
}

/// How one backend's SQL spells the filler rows.
pub(crate) struct Dialect {
    /// A row source of the integers `lo..hi` as a column `i`.
    series: fn(u64, u64) -> String,
    /// A 32-byte key digest for row `i`, as the store's SHA-256 of a scoped key would be.
    digest: &'static str,
    /// A literal of these bytes.
    blob: fn(&[u8]) -> String,
    pub(crate) analyze: &'static str,
}

/// Rows per filler INSERT: bounded transactions (undo, WAL) whatever `BENCH_SCALE` is. MySQL's
/// series is a two-way cross join of 0..999, which caps a statement at 10^6 rows.
pub(crate) const FILL_CHUNK: u64 = 100_000;

#[cfg(feature = "postgres")]
pub(crate) const POSTGRES_FILL: Dialect = Dialect {
    series: |lo, hi| format!("generate_series({lo}::bigint, {}::bigint) AS s(i)", hi - 1),
    digest: "sha256(int8send(i))",
    blob: |bytes| format!("decode('{}', 'hex')", hex::encode(bytes)),
    analyze: "ANALYZE idempotency_records",
};

// A recursive CTE of 1000 rows, joined with itself: MariaDB stops recursion at 1000 iterations
// by default (max_recursive_iterations), MySQL 8 likewise (cte_max_recursion_depth).
#[cfg(feature = "mysql")]
pub(crate) const MYSQL_FILL: Dialect = Dialect {
    series: |lo, hi| {
        format!(
            "(WITH RECURSIVE d(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM d WHERE n < 999) \
             SELECT {lo} + a.n + 1000 * b.n AS i FROM d a, d b \
             WHERE b.n <= {} AND a.n + 1000 * b.n < {}) AS s",
            (hi - lo - 1) / 1000,
            hi - lo
        )
    },
    digest: "UNHEX(SHA2(i, 256))",
    blob: |bytes| format!("X'{}'", hex::encode(bytes)),
    analyze: "ANALYZE TABLE idempotency_records",
};

#[cfg(feature = "sqlite")]
pub(crate) const SQLITE_FILL: Dialect = Dialect {
    series: |lo, hi| {
        format!(
            "(WITH RECURSIVE s(i) AS (SELECT {lo} UNION ALL SELECT i + 1 FROM s WHERE i < {}) \
             SELECT i FROM s)",
            hi - 1
        )
    },
    digest: "randomblob(32)",
    blob: |bytes| format!("X'{}'", hex::encode(bytes)),
    analyze: "ANALYZE",
};

/// The INSERT of filler rows `lo..hi`: completed 201s of `POST /layer` with the store's header
/// encoding and a small body, so the table's pages hold what real records would. Rows below
/// `expired` expired an hour ago or more; the others expire within the retention from `now`,
/// spread over its last hour, so the expiry index is ordered as a real table's would be.
pub(crate) fn filler_insert(dialect: &Dialect, lo: u64, hi: u64, expired: u64, now: i64) -> String {
    use sha2::{Digest, Sha256};

    let mut headers = Vec::new();
    for field in [&b"content-type"[..], b"application/json"] {
        headers.extend_from_slice(&u32::try_from(field.len()).unwrap_or(0).to_be_bytes());
        headers.extend_from_slice(field);
    }
    let expires = format!(
        "CASE WHEN i < {expired} THEN {} - i ELSE {} - i % 3600000 END",
        now - 3_600_000,
        now + TTL_MS
    );
    format!(
        "INSERT INTO idempotency_records (key_digest, principal, method, route, fingerprint, \
         state, status, headers, body, created_at, expires_at) \
         SELECT {}, NULL, 'POST', '/layer', {}, 'completed', 201, {}, {}, {expires} - {TTL_MS}, \
         {expires} FROM {}",
        dialect.digest,
        (dialect.blob)(&Sha256::digest(ORDER_BODY.as_bytes())),
        (dialect.blob)(&headers),
        (dialect.blob)(br#"{"id":1}"#),
        (dialect.series)(lo, hi),
    )
}
