//! PostgreSQL: many dispatchers, on many hosts, share the table. A claim locks the due rows it
//! picks with `FOR UPDATE SKIP LOCKED`, so concurrent claims never wait on each other nor pick
//! the same row, and writes a lease that outlives the claim's short transaction.

use sqlx::Postgres;

use crate::backend::migrate::Schema;
use crate::backend::outbox::{in_key_order, record_columns};

// ON CONFLICT rather than catching the unique violation: an error would abort the caller's
// whole transaction.
pub(super) const INSERT: &str = "INSERT INTO idempotency_outbox
            (topic, downstream_key, payload, status, created_at, next_attempt_at, ordering_key,
             attempts, outcome_unknown, last_attempt_at, lease_token, lease_expires_at)
        VALUES ($1, $2, $3, 'pending', $4, $5, $6, $7, $8, $9, $10, $11)
        ON CONFLICT (downstream_key) DO NOTHING
        RETURNING id";
// A transaction-scoped advisory lock on the key's 64-bit hash, seeded with the table's oid:
// advisory locks belong to the whole database, and the seed keeps the outboxes of two schemas
// (two apps, two tenants) from queueing behind each other. Two keys with one hash only queue.
pub(super) const ORDER_LOCK: &str = "SELECT 1 FROM pg_advisory_xact_lock(
        hashtextextended($1, 'idempotency_outbox'::regclass::oid::bigint))";
pub(super) const FETCH_BY_ID: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_outbox WHERE id = $1"
);
pub(super) const FETCH_BY_KEY: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_outbox WHERE downstream_key = $1"
);
pub(super) const FETCH_BLOCKER: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_outbox
         WHERE ordering_key = (SELECT ordering_key FROM idempotency_outbox WHERE id = $1)
           AND id < $2 AND status IN ('pending', 'failed')
         ORDER BY id
         LIMIT 1"
);
// The CTE sees each row as it was, so the one statement both decides which messages are
// sent now and tells the dispatcher which attempts it began.
//
// Due order, ties in id (enqueue) order. The plan must read the due index in that order and
// stop at the limit, however many messages are due. Knowing the limit, the planner picks a
// bitmap scan and a sort of every due row instead whenever it expects fewer due rows than
// the limit, as on a table not yet analyzed (a new outbox's first minutes). A backlog then
// slows each claim, which grows the backlog. `LIMIT (SELECT $4)` hides the value from the
// planner, which then plans to read a tenth of the due rows, and the ordered index scan wins
// at any estimate. It also marks the index entries of finished messages dead as it passes
// them, which a bitmap scan never does.
//
// Here, `id = ANY (ARRAY(…))` repeats the join on the primary key as an index condition: the
// generic plan of a prepared statement guesses a hundred rows on the other side, and without
// it joins them by hashing the whole table.
//
// The topics are a filter on the rows the index scan reads, not an index condition. This
// claim runs while no topic is paused (`$6` empty), and `<> ALL` keeps the planner's estimate
// of the rows left high, so the ordered scan stays. A probe's claim,
// of one topic alone, writes its test as a `CASE`, which the planner counts as half the rows:
// `topic = $6` it counts as a handful on a table not yet analyzed, and then sorts every due
// message to find the topic's first (15,600 buffers and 40 ms under 30,000 due, against 4
// buffers and 0.4 ms).
//
// `FOR UPDATE` locks the rows of `m` only; the ordering rule's subquery reads without
// locking, so it sees an earlier message of the key that another claim holds locked.
macro_rules! claim {
    ($topics:literal) => {
        concat!(
            "WITH due AS (
             SELECT id AS due_id, NOT outcome_unknown AND attempts < $5 AS begins
             FROM idempotency_outbox AS m
             WHERE status = 'pending' AND next_attempt_at <= $3
               AND (lease_expires_at IS NULL OR lease_expires_at <= $3)
               AND ",
            $topics,
            "
               AND ",
            in_key_order!("m"),
            "
             ORDER BY next_attempt_at, id
             LIMIT (SELECT $4)
             FOR UPDATE SKIP LOCKED)
         ",
            lease_due!()
        )
    };
}
// Leases the rows of the CTE `due` (`due_id`, `begins`) and returns them.
macro_rules! lease_due {
    () => {
        concat!(
            "UPDATE idempotency_outbox
         SET lease_expires_at = $1, lease_token = $2,
             attempts = attempts + CASE WHEN begins THEN 1 ELSE 0 END,
             outcome_unknown = outcome_unknown OR begins,
             last_attempt_at = CASE WHEN begins THEN $3 ELSE last_attempt_at END
         FROM due
         WHERE id = due_id AND id = ANY (ARRAY(SELECT due_id FROM due))
         RETURNING begins AS attempt_begun, ",
            record_columns!()
        )
    };
}
// A claim is a lease, and its commit need not wait for the disk: should the server crash
// before its WAL reaches the disk, the claim is lost as if its lease had run out, and the message
// is claimed and sent again, which its downstream key deduplicates as after a dispatcher's
// crash mid-send. The settle after the send commits as the server is set to, and its flush
// carries the claim with it. The wait for the flush was most of a claim's time (one-row commit
// 3.1 ms against 0.13 ms without it, measured with pgbench on this project's loaded test machine),
// and a message no dispatcher took at its commit waits for one or two claims before its send.
pub(super) const BEGIN_CLAIM: &str = "BEGIN; SET LOCAL synchronous_commit = off";
// The hidden limit above makes the planner cost a claim at a tenth of the due messages: past
// about 120,000 due that crosses `jit_above_cost` (100,000 by default), and every claim then
// compiles its plan, 44 to 103 ms where the claim itself takes 1.5 to 1.9 (120,000 due, an
// analyzed table). Compiling buys nothing for a few dozen rows, so a claim that likely faces a
// backlog runs with JIT off.
pub(super) const BEGIN_BACKLOG_CLAIM: &str =
    "BEGIN; SET LOCAL synchronous_commit = off; SET LOCAL jit = off";
/// The claim of every topic, `$6` being empty.
pub(super) const CLAIM: &str = claim!("topic <> ALL ($6::text[])");
// While topics are paused, their backlogs are the oldest due messages: the due index has
// them first, and `CLAIM` would read past every one of them on each claim (30,000 cost it
// 540 buffers and 5 to 18 ms, against 62 buffers and 0.3 ms). This one reads none of them. It walks the topics that have pending
// messages, one probe of the topic index each (`ORDER BY topic LIMIT 1` past the last one
// found, paused topics included so the walk never reads their entries), then reads each
// other topic's due messages in due order from the same index, up to the limit each, and
// keeps `$4` of them all.
//
// A plain `LIMIT $4`, unlike `CLAIM`'s: the index gives one topic's messages in due order,
// so the planner has no sort to prefer. Hidden, the limit makes it budget a tenth of each
// topic's due messages for each of the hundred topics it guesses the walk returns, a cost
// above `jit_above_cost`: 250 to 440 ms of JIT compilation on each claim of an analyzed
// table.
// `SKIP LOCKED` is inside each topic's read, so it reads on past rows other claims hold;
// the rows it locks beyond the first `$4` are free again when its transaction ends.
//
// The topics take turns: each topic's first due message, then each one's second, and so on
// (due order within a turn). A backlog's claims run this one too, with nothing paused, so a
// destination's backlog (a broker back after an outage) delays the other topics' new
// messages by one claim, not by the whole backlog, though it is older. The turn is counted
// outside the locking read, where a window function may not be.
pub(super) const CLAIM_SKIPPING: &str = concat!(
    "WITH RECURSIVE pending_topics (topic) AS (
             (SELECT topic FROM idempotency_outbox WHERE status = 'pending'
              ORDER BY topic LIMIT 1)
             UNION ALL
             SELECT (SELECT later.topic FROM idempotency_outbox AS later
                     WHERE later.status = 'pending' AND later.topic > t.topic
                     ORDER BY later.topic LIMIT 1)
             FROM pending_topics AS t WHERE t.topic IS NOT NULL),
         due AS (
             SELECT d.id AS due_id, d.begins
             FROM pending_topics AS t CROSS JOIN LATERAL (
                 SELECT locked.*, row_number() OVER (ORDER BY next_attempt_at, id) AS turn
                 FROM (
                     SELECT id, next_attempt_at, NOT outcome_unknown AND attempts < $5 AS begins
                     FROM idempotency_outbox AS m
                     WHERE m.topic = t.topic AND status = 'pending' AND next_attempt_at <= $3
                       AND (lease_expires_at IS NULL OR lease_expires_at <= $3)
                       AND ",
    in_key_order!("m"),
    "
                     ORDER BY next_attempt_at, id
                     LIMIT $4
                     FOR UPDATE SKIP LOCKED) AS locked) AS d
             WHERE t.topic IS NOT NULL AND t.topic <> ALL ($6::text[])
             ORDER BY d.turn, d.next_attempt_at, d.id
             LIMIT $4)
         ",
    lease_due!()
);
/// The claim of the topic `$6` alone.
pub(super) const CLAIM_TOPIC: &str = claim!("CASE WHEN topic = $6 THEN TRUE ELSE FALSE END");
pub(super) const BEGIN_ATTEMPT: &str = "UPDATE idempotency_outbox
        SET attempts = attempts + 1, last_attempt_at = $1, outcome_unknown = TRUE
        WHERE id = $2 AND lease_token = $3";
// The batched writes below are sent with their JSON written in (see `batched` in the
// backend), so each is planned for the table as it is; the CTE names the JSON's rows once, and
// `id = ANY (ARRAY(…))` repeats the join on the primary key as an index condition.
/// A renewal of leases, around its time and its JSON array of `{id, token}`.
pub(super) const RENEW_LEASES: [&str; 3] = [
    "WITH h AS MATERIALIZED (SELECT * FROM jsonb_to_recordset(",
    "::jsonb) AS h(id bigint, token bigint))
         UPDATE idempotency_outbox SET lease_expires_at = ",
    " FROM h
         WHERE idempotency_outbox.id = h.id AND lease_token = h.token
           AND idempotency_outbox.id = ANY (ARRAY(SELECT id FROM h))
         RETURNING idempotency_outbox.id",
];
/// A release of leases on messages not sent, around its JSON array of `{id, token}`.
pub(super) const RELEASE_UNSENT: [&str; 2] = [
    "WITH r AS MATERIALIZED (SELECT * FROM jsonb_to_recordset(",
    "::jsonb) AS r(id bigint, token bigint))
         UPDATE idempotency_outbox
         SET last_attempt_at = CASE WHEN attempts = 1 THEN NULL ELSE last_attempt_at END,
             attempts = attempts - 1, outcome_unknown = FALSE,
             lease_expires_at = NULL, lease_token = NULL
         FROM r
         WHERE idempotency_outbox.id = r.id AND lease_token = r.token AND outcome_unknown
           AND idempotency_outbox.id = ANY (ARRAY(SELECT id FROM r))
         RETURNING idempotency_outbox.id",
];
/// A settle, around its JSON array of outcomes.
pub(super) const SETTLE: [&str; 2] = [
    "WITH s AS MATERIALIZED (SELECT * FROM jsonb_to_recordset(",
    "::jsonb) AS s(id bigint, token bigint, status text, receipt text, last_error text,
             attempts bigint, outcome_unknown boolean, next_attempt_at bigint,
             finished_at bigint, last_attempt_at bigint))
         UPDATE idempotency_outbox
         SET status = s.status, receipt = s.receipt, last_error = s.last_error,
             attempts = s.attempts,
             outcome_unknown = s.outcome_unknown, next_attempt_at = s.next_attempt_at,
             finished_at = s.finished_at,
             last_attempt_at = COALESCE(s.last_attempt_at, idempotency_outbox.last_attempt_at),
             lease_expires_at = NULL, lease_token = NULL
         FROM s
         WHERE idempotency_outbox.id = s.id AND lease_token = s.token
           AND idempotency_outbox.id = ANY (ARRAY(SELECT id FROM s))
         RETURNING idempotency_outbox.id",
];
pub(super) const PURGE_FINISHED: &str = "DELETE FROM idempotency_outbox WHERE id IN (
        SELECT id FROM idempotency_outbox WHERE status IN ('delivered', 'skipped') AND finished_at < $1
        ORDER BY finished_at LIMIT $2)";
pub(super) const REQUEUE: &str = "UPDATE idempotency_outbox
        SET status = 'pending', attempts = 0, next_attempt_at = $1, requeued_at = $1,
            finished_at = NULL,
            lease_expires_at = NULL, lease_token = NULL
        WHERE id = $2 AND status = 'failed'";
pub(super) const SKIP: &str = "UPDATE idempotency_outbox
        SET status = 'skipped', finished_at = $1, lease_expires_at = NULL, lease_token = NULL
        WHERE id = $2 AND status = 'failed'";
// `CREATE TABLE IF NOT EXISTS` alone races in PostgreSQL (both sessions see no table, one
// fails on the catalog's unique index), so migrators queue on a transaction-scoped advisory
// lock; the number is the outbox's own ("axoutbox" in ASCII). Advisory locks belong to one
// database, so outboxes in other databases of the server do not queue behind each other.
pub(super) const SCHEMA: Schema<Postgres> = Schema {
    // Apart from the records' versions, so the two schemas evolve independently.
    versions_table: "idempotency_outbox_schema_versions",
    scripts: &[(
        1,
        include_str!("../../../migrations/postgres/outbox/0001_outbox.sql"),
    )],
    begin: "BEGIN",
    lock: Some("SELECT pg_advisory_xact_lock(7023486169138753400)"),
    unlock: None,
    lock_granted: |_| true,
    record: "INSERT INTO idempotency_outbox_schema_versions (version, applied_at) VALUES ($1, $2)",
};
