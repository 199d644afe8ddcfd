//! SQLite: one writer at a time, so a claim is a single `UPDATE … RETURNING` that no other
//! dispatcher can interleave with; the lease still matters when a dispatcher dies mid-send.

use sqlx::Sqlite;

use crate::backend::migrate::Schema;
use crate::backend::outbox::{in_key_order, record_columns};

pub(super) const INSERT: &str = "INSERT INTO idempotency_outbox
            (topic, downstream_key, payload, status, created_at, next_attempt_at, ordering_key,
             attempts, outcome_unknown, last_attempt_at, lease_token, lease_expires_at)
        VALUES (?1, ?2, ?3, 'pending', ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
        ON CONFLICT (downstream_key) DO NOTHING
        RETURNING id";
pub(super) const FETCH_BY_ID: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_outbox WHERE id = ?1"
);
pub(super) const FETCH_BY_KEY: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_outbox WHERE downstream_key = ?1"
);
pub(super) const FETCH_BLOCKER: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_outbox
         WHERE ordering_key = (SELECT ordering_key FROM idempotency_outbox WHERE id = ?1)
           AND id < ?2 AND status IN ('pending', 'failed')
         ORDER BY id
         LIMIT 1"
);
// The topics left out come as a JSON array, the one topic taken (a paused destination's
// probe) as text or NULL.
//
// An UPDATE takes the database's write lock even when it matches nothing; reading first
// keeps an idle dispatcher from queueing behind (and stalling) the app's transactions.
pub(super) const CLAIM_PROBE: &str = concat!(
    "SELECT EXISTS (
             SELECT 1 FROM idempotency_outbox AS m
             WHERE status = 'pending' AND next_attempt_at <= ?1
               AND (lease_expires_at IS NULL OR lease_expires_at <= ?1)
               AND topic NOT IN (SELECT value FROM json_each(?2)) AND (?3 IS NULL OR topic = ?3)
               AND ",
    in_key_order!("m"),
    ")"
);
// The ids of the first `?4` messages due at `?3` of the topics the claim takes (none in the
// JSON array `?6`, only `?7` unless it is NULL) that also meet `$also`.
macro_rules! due {
    ($also:literal) => {
        concat!(
            "SELECT id FROM idempotency_outbox AS m
                 WHERE status = 'pending' AND next_attempt_at <= ?3
                   AND (lease_expires_at IS NULL OR lease_expires_at <= ?3)
                   AND topic NOT IN (SELECT value FROM json_each(?6))
                   AND (?7 IS NULL OR topic = ?7)",
            $also,
            "
                   AND ",
            in_key_order!("m"),
            "
                 ORDER BY next_attempt_at, id
                 LIMIT ?4"
        )
    };
}
// RETURNING sees only the row as updated, so one statement could not tell a message whose
// attempt it began from one whose last outcome was already unknown. The lease columns are
// not among the record's, so `CLAIM_HOLD`, which writes nothing else, returns the rows as they
// were. Once it has leased the first `limit` due messages that are not sent now, the first
// due ones left are those that are.
pub(super) const CLAIM_HOLD: &str = concat!(
    "UPDATE idempotency_outbox SET lease_expires_at = ?1, lease_token = ?2
             WHERE id IN (",
    due!(""),
    ")
               AND (outcome_unknown OR attempts >= ?5)
             RETURNING ",
    record_columns!()
);
pub(super) const CLAIM_BEGIN: &str = concat!(
    "UPDATE idempotency_outbox
             SET lease_expires_at = ?1, lease_token = ?2,
                 attempts = attempts + 1, last_attempt_at = ?3, outcome_unknown = TRUE
             WHERE id IN (",
    due!(
        "
                   AND NOT outcome_unknown AND attempts < ?5"
    ),
    ")
             RETURNING ",
    record_columns!()
);
// While topics are paused, their backlogs are the oldest due messages: the due index has
// them first, and the three statements above read past every one of them (30,000 cost each
// 6 to 12 ms under the write lock). These read none of them. They walk the topics that have
// pending messages, one probe of the topic index each (`ORDER BY topic LIMIT 1` past the
// last one found, paused topics included so the walk never reads their entries), then read
// each other topic's due messages in due order from the same index, up to the limit each,
// and keep the limit of them all, the topics taking turns: each one's first due message,
// then each one's second, and so on. A backlog's claims run these too, with nothing paused,
// so that a destination's backlog (a broker back after an outage) delays the other topics'
// new messages by one claim, not by the whole backlog, though it is older.
// `INDEXED BY`: the planner otherwise walks the topics through the due index, which has
// `status` first, and sorts every pending message.
macro_rules! pending_topics {
    () => {
        "WITH RECURSIVE pending_topics (topic) AS (
             SELECT (SELECT topic FROM idempotency_outbox INDEXED BY idempotency_outbox_topic_due
                     WHERE status = 'pending' ORDER BY topic LIMIT 1)
             UNION ALL
             SELECT (SELECT later.topic
                     FROM idempotency_outbox AS later INDEXED BY idempotency_outbox_topic_due
                     WHERE later.status = 'pending' AND later.topic > t.topic
                     ORDER BY later.topic LIMIT 1)
             FROM pending_topics AS t WHERE t.topic IS NOT NULL) "
    };
}
// The ids of the first `$limit` due messages of the topics not in the JSON array `$skipped`,
// at `$now`, that also meet `$also`.
macro_rules! due_not_skipped {
    ($now:literal, $skipped:literal, $limit:literal, $also:literal) => {
        concat!(
            "SELECT due.id
             FROM pending_topics AS t JOIN idempotency_outbox AS due ON due.id IN (
                 SELECT m.id FROM idempotency_outbox AS m INDEXED BY idempotency_outbox_topic_due
                 WHERE m.topic = t.topic AND status = 'pending' AND next_attempt_at <= ",
            $now,
            "
                   AND (lease_expires_at IS NULL OR lease_expires_at <= ",
            $now,
            ")",
            $also,
            "
                   AND ",
            in_key_order!("m"),
            "
                 ORDER BY next_attempt_at, id
                 LIMIT ",
            $limit,
            ")
             WHERE t.topic IS NOT NULL
               AND t.topic NOT IN (SELECT value FROM json_each(",
            $skipped,
            "))
             ORDER BY row_number() OVER (
                          PARTITION BY due.topic ORDER BY due.next_attempt_at, due.id),
                      due.next_attempt_at, due.id
             LIMIT ",
            $limit
        )
    };
}
/// `CLAIM_PROBE` of every topic but those in the JSON array `?2`, which is not empty.
pub(super) const CLAIM_PROBE_SKIPPING: &str = concat!(
    pending_topics!(),
    "SELECT EXISTS (",
    due_not_skipped!("?1", "?2", "1", ""),
    ")"
);
/// `CLAIM_HOLD` of every topic but those in the JSON array `?6`, which is not empty.
pub(super) const CLAIM_HOLD_SKIPPING: &str = concat!(
    pending_topics!(),
    "UPDATE idempotency_outbox SET lease_expires_at = ?1, lease_token = ?2
             WHERE id IN (",
    due_not_skipped!("?3", "?6", "?4", ""),
    ")
               AND (outcome_unknown OR attempts >= ?5)
             RETURNING ",
    record_columns!()
);
/// `CLAIM_BEGIN` of every topic but those in the JSON array `?6`, which is not empty.
pub(super) const CLAIM_BEGIN_SKIPPING: &str = concat!(
    pending_topics!(),
    "UPDATE idempotency_outbox
             SET lease_expires_at = ?1, lease_token = ?2,
                 attempts = attempts + 1, last_attempt_at = ?3, outcome_unknown = TRUE
             WHERE id IN (",
    due_not_skipped!(
        "?3",
        "?6",
        "?4",
        "
                   AND NOT outcome_unknown AND attempts < ?5"
    ),
    ")
             RETURNING ",
    record_columns!()
);
pub(super) const BEGIN_ATTEMPT: &str = "UPDATE idempotency_outbox
        SET attempts = attempts + 1, last_attempt_at = ?1, outcome_unknown = TRUE
        WHERE id = ?2 AND lease_token = ?3";
pub(super) const RENEW_LEASES: &str = "UPDATE idempotency_outbox SET lease_expires_at = ?1
         FROM (SELECT value ->> 'id' AS held_id, value ->> 'token' AS held_token
               FROM json_each(?2)) AS h
         WHERE id = h.held_id AND lease_token = h.held_token
         RETURNING id";
pub(super) const RELEASE_UNSENT: &str = "UPDATE idempotency_outbox
         SET last_attempt_at = CASE WHEN attempts = 1 THEN NULL ELSE last_attempt_at END,
             attempts = attempts - 1, outcome_unknown = FALSE,
             lease_expires_at = NULL, lease_token = NULL
         FROM (SELECT value ->> 'id' AS released_id, value ->> 'token' AS released_token
               FROM json_each(?1)) AS r
         WHERE id = r.released_id AND lease_token = r.released_token AND outcome_unknown
         RETURNING id";
pub(super) const SETTLE: &str = "UPDATE idempotency_outbox
         SET status = s.status, receipt = s.receipt, last_error = s.last_error,
             attempts = s.attempts, outcome_unknown = s.outcome_unknown, next_attempt_at = s.next_attempt_at,
             finished_at = s.finished_at,
             last_attempt_at = COALESCE(s.last_attempt_at, idempotency_outbox.last_attempt_at),
             lease_expires_at = NULL, lease_token = NULL
         FROM (SELECT value ->> 'id' AS settled_id, value ->> 'token' AS token,
                      value ->> 'status' AS status, value ->> 'receipt' AS receipt,
                      value ->> 'last_error' AS last_error,
                      value ->> 'attempts' AS attempts,
                      value ->> 'outcome_unknown' AS outcome_unknown,
                      value ->> 'next_attempt_at' AS next_attempt_at,
                      value ->> 'finished_at' AS finished_at,
                      value ->> 'last_attempt_at' AS last_attempt_at
               FROM json_each(?1)) AS s
         WHERE id = s.settled_id AND lease_token = s.token
         RETURNING id";
pub(super) const PURGE_FINISHED: &str = "DELETE FROM idempotency_outbox WHERE id IN (
        SELECT id FROM idempotency_outbox WHERE status IN ('delivered', 'skipped') AND finished_at < ?1
        ORDER BY finished_at LIMIT ?2)";
pub(super) const REQUEUE: &str = "UPDATE idempotency_outbox
        SET status = 'pending', attempts = 0, next_attempt_at = ?1, requeued_at = ?1,
            finished_at = NULL,
            lease_expires_at = NULL, lease_token = NULL
        WHERE id = ?2 AND status = 'failed'";
pub(super) const SKIP: &str = "UPDATE idempotency_outbox
        SET status = 'skipped', finished_at = ?1, lease_expires_at = NULL, lease_token = NULL
        WHERE id = ?2 AND status = 'failed'";
pub(super) const SCHEMA: Schema<Sqlite> = Schema {
    // Apart from the records' versions, so the two schemas evolve independently.
    versions_table: "idempotency_outbox_schema_versions",
    scripts: &[(
        1,
        include_str!("../../../migrations/sqlite/outbox/0001_outbox.sql"),
    )],
    // The write lock taken up front serialises concurrent migrators.
    begin: "BEGIN IMMEDIATE",
    lock: None,
    unlock: None,
    lock_granted: |_| true,
    record: "INSERT INTO idempotency_outbox_schema_versions (version, applied_at) VALUES (?1, ?2)",
};
