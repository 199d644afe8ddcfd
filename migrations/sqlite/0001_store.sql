-- axum-idempotency store schema version 1 (SQLite): the records and the inbox's dedupe keys.

-- Records live in their own table, keyed by the SHA-256 of the scoped key; the raw key is never
-- stored. The lease columns serve claims that outlive one transaction.
CREATE TABLE IF NOT EXISTS idempotency_records (
    key_digest       BLOB    PRIMARY KEY NOT NULL,
    principal        TEXT,
    method           TEXT    NOT NULL,
    route            TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL,
    state            TEXT    NOT NULL,
    status           INTEGER,
    headers          BLOB,
    body             BLOB,
    created_at       INTEGER NOT NULL,
    expires_at       INTEGER NOT NULL,
    lease_owner      BLOB,
    lease_expires_at INTEGER
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);

-- The inbox's dedupe keys. An inbox never replays a stored response: a key it finds claimed is a
-- duplicate, whatever the record says. So its claim keeps only the key's digest and when the key
-- expires, and is one insert in the handler's transaction, where the primary key decides, as a
-- hand-written dedupe table's would: no read of the key first, and no second write at commit.
CREATE TABLE IF NOT EXISTS idempotency_inbox (
    key_digest BLOB    PRIMARY KEY NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_inbox_expires_at ON idempotency_inbox (expires_at);
