-- axum-idempotency schema version 1 (PostgreSQL).
-- Records live in their own table, keyed by the SHA-256 of the scoped key; the raw key is never stored.
CREATE TABLE IF NOT EXISTS idempotency_records (
    key_digest  BYTEA   PRIMARY KEY,
    principal   TEXT,
    method      TEXT    NOT NULL,
    route       TEXT    NOT NULL,
    fingerprint BYTEA   NOT NULL,
    state       TEXT    NOT NULL,
    status      INTEGER,
    headers     BYTEA,
    body        BYTEA,
    created_at  BIGINT  NOT NULL,
    expires_at  BIGINT  NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);
