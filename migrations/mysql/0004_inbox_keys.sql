-- axum-idempotency schema version 4 (MySQL 8 / MariaDB 10.6+): the inbox's dedupe keys in a table
-- of their own.
-- An inbox never replays a stored response: a key it finds claimed is a duplicate, whatever the
-- record says. So its claim keeps only the key's digest and when the key expires, and is one
-- insert in the handler's transaction, where the primary key decides, as a hand-written dedupe
-- table's would: no procedure, and no second write at commit.
-- MySQL commits DDL implicitly, so this script is safe to run twice.
CREATE TABLE IF NOT EXISTS idempotency_inbox (
    key_digest BINARY(32) NOT NULL PRIMARY KEY,
    expires_at BIGINT     NOT NULL,
    INDEX idempotency_inbox_expires_at (expires_at)
) ENGINE = InnoDB;
-- Keys the inbox claimed as records before this version stay claimed: a redelivery of a message
-- applied before the upgrade is still a duplicate after it.
INSERT IGNORE INTO idempotency_inbox (key_digest, expires_at)
    SELECT key_digest, expires_at FROM idempotency_records
    WHERE method = 'CONSUME' AND route IN ('business-key', 'message-id') AND state = 'completed';
