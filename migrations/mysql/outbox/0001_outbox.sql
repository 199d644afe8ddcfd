-- axum-idempotency outbox schema version 1 (MySQL 8, MariaDB 10.6+).
-- MySQL commits DDL implicitly, so this script must be safe to run twice (IF NOT EXISTS): a
-- migration that stopped before recording its version completes on the next run.
-- The key column is ASCII with a binary collation: keys are compared byte for byte, never
-- case-folded, and 255 ASCII characters stay within InnoDB's index length limit.
CREATE TABLE IF NOT EXISTS idempotency_outbox (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    -- Indexed with the status: claims walk the topics that have pending messages. Binary
    -- collation: topics compare by their bytes (but for trailing spaces, which it ignores).
    topic VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    downstream_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    payload LONGBLOB NOT NULL,
    status VARCHAR(16) NOT NULL,
    attempts BIGINT NOT NULL DEFAULT 0,
    outcome_unknown BOOLEAN NOT NULL DEFAULT FALSE,
    receipt TEXT NULL,
    last_error TEXT NULL,
    created_at BIGINT NOT NULL,
    next_attempt_at BIGINT NOT NULL,
    last_attempt_at BIGINT NULL,
    finished_at BIGINT NULL,
    -- When an operator last requeued a failed message; its time budget counts from then.
    requeued_at BIGINT NULL,
    lease_expires_at BIGINT NULL,
    lease_token BIGINT NULL,
    -- Messages with the same ordering key are delivered one at a time, in id order. Binary
    -- collation: keys are compared byte for byte, as on the other backends.
    ordering_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    UNIQUE KEY idempotency_outbox_key (downstream_key),
    KEY idempotency_outbox_due (status, next_attempt_at),
    -- A paused topic's backlog is left out of a claim without being read.
    KEY idempotency_outbox_topic_due (status, topic, next_attempt_at),
    -- Serves the claim's check for an earlier unfinished message of the same ordering key.
    KEY idempotency_outbox_ordering (ordering_key, status, id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
-- One row per ordering key ever enqueued: enqueue locks it for the rest of its transaction,
-- so two transactions enqueuing for one key take their ids in the order they commit.
CREATE TABLE IF NOT EXISTS idempotency_outbox_order_locks (
    ordering_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL PRIMARY KEY
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
