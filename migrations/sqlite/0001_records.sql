-- axum-idempotency schema version 1 (SQLite).
-- Records live in their own table, keyed by the SHA-256 of the scoped key; the raw key is never stored.
CREATE TABLE IF NOT EXISTS idempotency_records (
    key_digest  BLOB    PRIMARY KEY NOT NULL,
    principal   TEXT,
    method      TEXT    NOT NULL,
    route       TEXT    NOT NULL,
    fingerprint BLOB    NOT NULL,
    state       TEXT    NOT NULL,
    status      INTEGER,
    headers     BLOB,
    body        BLOB,
    created_at  INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);
