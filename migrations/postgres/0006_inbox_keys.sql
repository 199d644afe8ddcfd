-- axum-idempotency schema version 6 (PostgreSQL): the inbox's dedupe keys in a table of their own.
-- An inbox never replays a stored response: a key it finds claimed is a duplicate, whatever the
-- record says. So its claim keeps only the key's digest and when the key expires, and is one
-- plain insert in the handler's transaction, where the primary key decides, as a hand-written
-- dedupe table's would: no procedure, no advisory lock, no read of the key first, and no second
-- write at commit. A concurrent delivery of the key waits on the first's index entry.
-- The expiry index is a BRIN: keys are inserted in the order they expire (one retention per
-- inbox), so a block range summary finds the expired ones for the purge, at almost no cost per
-- insert, where a B-tree would add a second index entry to every claim.
CREATE TABLE IF NOT EXISTS idempotency_inbox (
    key_digest BYTEA  PRIMARY KEY,
    expires_at BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_inbox_expires_at ON idempotency_inbox USING brin (expires_at);
-- Keys the inbox claimed as records before this version stay claimed: a redelivery of a message
-- applied before the upgrade is still a duplicate after it.
INSERT INTO idempotency_inbox (key_digest, expires_at)
    SELECT key_digest, expires_at FROM idempotency_records
    WHERE method = 'CONSUME' AND route IN ('business-key', 'message-id') AND state = 'completed'
ON CONFLICT (key_digest) DO NOTHING;
