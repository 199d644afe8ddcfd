-- axum-idempotency schema version 1 (MySQL 8 / MariaDB 10.6+).
-- Records live in their own table, keyed by the SHA-256 of the scoped key; the raw key is never stored.
-- It already holds the lease columns that PostgreSQL and SQLite add in their version 2.
-- MySQL commits DDL implicitly, so this script must be safe to run twice (IF NOT EXISTS, the index
-- declared inline: MySQL 8 has no CREATE INDEX IF NOT EXISTS, nor ADD COLUMN IF NOT EXISTS).
-- headers and body are LONGBLOB (up to 4 GiB): a MEDIUMBLOB stops at 16 MiB, below what
-- `max_response_body` may be configured to, and costs the same per row. The practical ceiling
-- is the server's max_allowed_packet, which must exceed the largest response stored.
-- utf8mb4_bin compares text byte for byte, the same on MySQL 8 and MariaDB whatever their defaults.
CREATE TABLE IF NOT EXISTS idempotency_records (
    key_digest  BINARY(32)  NOT NULL PRIMARY KEY,
    principal   TEXT,
    method      TEXT        NOT NULL,
    route       TEXT        NOT NULL,
    fingerprint BINARY(32)  NOT NULL,
    state       VARCHAR(32) NOT NULL,
    status      INT,
    headers     LONGBLOB,
    body        LONGBLOB,
    created_at  BIGINT      NOT NULL,
    expires_at  BIGINT      NOT NULL,
    lease_owner      BINARY(16),
    lease_expires_at BIGINT,
    INDEX idempotency_records_expires_at (expires_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
