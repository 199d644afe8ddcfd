-- axum-idempotency outbox schema version 1 (PostgreSQL).
-- IF NOT EXISTS: safe to run again over its own tables, such as ones a migration tool created
-- without recording the version.
CREATE TABLE IF NOT EXISTS idempotency_outbox (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic TEXT NOT NULL,
    downstream_key TEXT NOT NULL UNIQUE,
    payload BYTEA NOT NULL,
    status TEXT NOT NULL,
    attempts BIGINT NOT NULL DEFAULT 0,
    outcome_unknown BOOLEAN NOT NULL DEFAULT FALSE,
    receipt TEXT,
    last_error TEXT,
    created_at BIGINT NOT NULL,
    next_attempt_at BIGINT NOT NULL,
    last_attempt_at BIGINT,
    finished_at BIGINT,
    -- When an operator last requeued a failed message; its time budget counts from then.
    requeued_at BIGINT,
    lease_expires_at BIGINT,
    lease_token BIGINT,
    -- Messages with the same ordering key are delivered one at a time, in id order.
    ordering_key TEXT
);
-- The claim's: pending messages only, in the order it takes them, so it reads them in index
-- order and stops at its limit. Finished messages, most of the table, are not in it.
CREATE INDEX IF NOT EXISTS idempotency_outbox_due
    ON idempotency_outbox (next_attempt_at, id) WHERE status = 'pending';
-- A claim that leaves paused topics out: it finds the topics with pending messages one index
-- probe each, then reads each other topic's due messages in due order, never the entries of a
-- paused topic's backlog, which the index above has first.
CREATE INDEX IF NOT EXISTS idempotency_outbox_topic_due
    ON idempotency_outbox (topic, next_attempt_at, id) WHERE status = 'pending';
-- Serves the claim's check for an earlier unfinished message of the same ordering key.
CREATE INDEX IF NOT EXISTS idempotency_outbox_ordering
    ON idempotency_outbox (ordering_key, status, id) WHERE ordering_key IS NOT NULL;
