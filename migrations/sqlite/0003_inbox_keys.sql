-- axum-idempotency schema version 3 (SQLite): the inbox's dedupe keys in a table of their own.
-- An inbox never replays a stored response: a key it finds claimed is a duplicate, whatever the
-- record says. So its claim keeps only the key's digest and when the key expires, and is one
-- insert in the handler's transaction, where the primary key decides, as a hand-written dedupe
-- table's would: no read of the key first, and no second write at commit.
CREATE TABLE IF NOT EXISTS idempotency_inbox (
    key_digest BLOB    PRIMARY KEY NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_inbox_expires_at ON idempotency_inbox (expires_at);
-- Keys the inbox claimed as records before this version stay claimed: a redelivery of a message
-- applied before the upgrade is still a duplicate after it.
INSERT OR IGNORE INTO idempotency_inbox (key_digest, expires_at)
    SELECT key_digest, expires_at FROM idempotency_records
    WHERE method = 'CONSUME' AND route IN ('business-key', 'message-id') AND state = 'completed';
