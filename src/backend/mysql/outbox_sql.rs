//! MySQL and MariaDB (10.6+ for `SKIP LOCKED`): like PostgreSQL, concurrent dispatchers skip
//! each other's locked rows. Without `UPDATE … RETURNING`, a claim reads the due rows with
//! `FOR UPDATE SKIP LOCKED` and leases them in the same short transaction.

use sqlx::MySql;

use super::migration_locked;
use crate::backend::migrate::Schema;
use crate::backend::outbox::{in_key_order, record_columns};

pub(super) const INSERT: &str = "INSERT INTO idempotency_outbox
            (topic, downstream_key, payload, status, created_at, next_attempt_at, ordering_key,
             attempts, outcome_unknown, last_attempt_at, lease_token, lease_expires_at)
        VALUES (?, ?, ?, 'pending', ?, ?, ?, ?, ?, ?, ?, ?)";
// An exclusive lock on the key's own row, held to the end of the caller's transaction
// (InnoDB locks the duplicate row of an `ON DUPLICATE KEY UPDATE` exclusively, even when
// nothing changes). A gap or next-key lock on the outbox's own index would not do: two of
// them do not conflict, and the two inserts would then deadlock.
pub(super) const ORDER_LOCK: &str =
    "INSERT INTO idempotency_outbox_order_locks (ordering_key) VALUES (?)
         ON DUPLICATE KEY UPDATE ordering_key = ordering_key";
pub(super) const FETCH_BY_ID: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_outbox WHERE id = ?"
);
pub(super) const FETCH_BY_KEY: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_outbox WHERE downstream_key = ?"
);
pub(super) const FETCH_BLOCKER: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_outbox
         WHERE ordering_key = (SELECT ordering_key FROM idempotency_outbox WHERE id = ?)
           AND id < ? AND status IN ('pending', 'failed')
         ORDER BY id
         LIMIT 1"
);
// `FOR UPDATE` locks the rows of `m`; the ordering rule's subquery is a consistent read
// (MySQL: "a locking read clause in an outer statement does not lock the rows of a table
// in a nested subquery"; MariaDB alike), so it sees, and waits behind, an earlier message
// of the key another claim holds locked rather than skipping it.
macro_rules! claim_select {
    ($index:literal, $topic:literal) => {
        concat!(
            "SELECT ",
            record_columns!(),
            " FROM idempotency_outbox AS m ",
            $index,
            "
             WHERE status = 'pending' ",
            $topic,
            " AND next_attempt_at <= ?
               AND (lease_expires_at IS NULL OR lease_expires_at <= ?)
               AND ",
            in_key_order!("m"),
            "
             ORDER BY next_attempt_at, id
             LIMIT ?
             FOR UPDATE SKIP LOCKED"
        )
    };
}
/// The first due messages of every topic.
pub(super) const CLAIM_SELECT: &str = claim_select!("", "");
/// The first due messages of the topic bound first. With topics paused, a claim reads each
/// other topic's from the topic index, as far as its limit: read in due order over all
/// topics, it would walk past every message of a paused backlog (72–127 ms per claim with
/// 30,000 waiting), since those are the oldest.
pub(super) const CLAIM_SELECT_TOPIC: &str = claim_select!(
    "FORCE INDEX (idempotency_outbox_topic_due)",
    "AND topic = ?"
);
// The topics with pending messages, one index probe each (MariaDB reads every pending entry
// for a `GROUP BY` or a recursive walk, whose bound is not a constant it can plan a range on).
// The collation pads with spaces, so a topic that differs from another only by trailing
// spaces is found, and read, with it; the claim keeps each row to its exact topic.
pub(super) const FIRST_PENDING_TOPIC: &str =
    "SELECT topic FROM idempotency_outbox FORCE INDEX (idempotency_outbox_topic_due)
         WHERE status = 'pending' ORDER BY topic LIMIT 1";
pub(super) const NEXT_PENDING_TOPIC: &str =
    "SELECT topic FROM idempotency_outbox FORCE INDEX (idempotency_outbox_topic_due)
         WHERE status = 'pending' AND topic > ? ORDER BY topic LIMIT 1";
pub(super) const CLAIM_HOLD: &str =
    "UPDATE idempotency_outbox SET lease_expires_at = ?, lease_token = ? WHERE id = ?";
pub(super) const CLAIM_BEGIN: &str = "UPDATE idempotency_outbox
            SET lease_expires_at = ?, lease_token = ?,
                attempts = attempts + 1, last_attempt_at = ?, outcome_unknown = TRUE
            WHERE id = ?";
// sqlx connects with CLIENT_FOUND_ROWS, so the count is of the rows matched, not changed:
// 1 exactly while the lease is held, even for a renewal that writes the value it finds.
pub(super) const RENEW_LEASES: &str =
    "UPDATE idempotency_outbox SET lease_expires_at = ? WHERE id = ? AND lease_token = ?";
pub(super) const BEGIN_ATTEMPT: &str = "UPDATE idempotency_outbox
        SET attempts = attempts + 1, last_attempt_at = ?, outcome_unknown = TRUE
        WHERE id = ? AND lease_token = ?";
// MySQL refuses LIMIT in an IN subquery but takes it on DELETE itself.
pub(super) const PURGE_FINISHED: &str = "DELETE FROM idempotency_outbox
        WHERE status IN ('delivered', 'skipped') AND finished_at < ? ORDER BY finished_at LIMIT ?";
pub(super) const REQUEUE: &str = "UPDATE idempotency_outbox
        SET status = 'pending', attempts = 0, next_attempt_at = ?,
            -- MySQL assigns left to right: the new value.
            requeued_at = next_attempt_at,
            finished_at = NULL,
            lease_expires_at = NULL, lease_token = NULL
        WHERE id = ? AND status = 'failed'";
pub(super) const SKIP: &str = "UPDATE idempotency_outbox
        SET status = 'skipped', finished_at = ?, lease_expires_at = NULL, lease_token = NULL
        WHERE id = ? AND status = 'failed'";
// Without UPDATE … RETURNING, a batch could only say how many leases held, not which; one
// statement per lease counts the rows it matched (CLIENT_FOUND_ROWS), 1 exactly when the
// lease was still ours.
// MySQL assigns left to right, each seeing the ones before: `last_attempt_at` comes first
// so it reads the attempts the claim left.
pub(super) const RELEASE_UNSENT: &str = "UPDATE idempotency_outbox
        SET last_attempt_at = CASE WHEN attempts = 1 THEN NULL ELSE last_attempt_at END,
            attempts = attempts - 1, outcome_unknown = FALSE,
            lease_expires_at = NULL, lease_token = NULL
        WHERE id = ? AND lease_token = ? AND outcome_unknown";
pub(super) const SETTLE: &str = "UPDATE idempotency_outbox
        SET status = ?, receipt = ?, last_error = ?, attempts = ?, outcome_unknown = ?,
            next_attempt_at = ?, finished_at = ?,
            last_attempt_at = COALESCE(?, last_attempt_at),
            lease_expires_at = NULL, lease_token = NULL
        WHERE id = ? AND lease_token = ?";
// DDL commits implicitly, so the transaction cannot serialise two instances migrating at
// once; a named lock held by the session can. Lock names are server-wide, so the name
// carries the database (hashed: names stop at 64 characters), as the store's does, and
// outboxes on other databases of the same server do not queue behind each other. It is not
// the store's lock: the two schemas migrate apart. MariaDB has no "wait forever" (a negative
// timeout returns NULL at once), so the wait is an hour, after which migrate fails.
pub(super) const SCHEMA: Schema<MySql> = Schema {
    // Apart from the records' versions, so the two schemas evolve independently.
    versions_table: "idempotency_outbox_schema_versions",
    scripts: &[(
        1,
        include_str!("../../../migrations/mysql/outbox/0001_outbox.sql"),
    )],
    begin: "BEGIN",
    lock: Some("SELECT GET_LOCK(CONCAT('axum_idempotency.outbox:', MD5(DATABASE())), 3600)"),
    unlock: Some("DO RELEASE_LOCK(CONCAT('axum_idempotency.outbox:', MD5(DATABASE())))"),
    lock_granted: migration_locked,
    record: "INSERT INTO idempotency_outbox_schema_versions (version, applied_at) VALUES (?, ?)",
};
