-- axum-idempotency schema version 3 (SQLite): a claim sent with BEGIN IMMEDIATE.
-- SQLite raises an error from a statement only inside a trigger, so the claim is an insert into a
-- view that stores nothing: its trigger rolls the transaction back with RAISE(ROLLBACK) when a live
-- record holds the key, and does nothing otherwise. The layer sends it in the same call as
-- BEGIN IMMEDIATE, whose write lock is the key's lock; the record is written once, as the
-- transaction commits. Rolling back, rather than failing the statement alone, leaves no
-- transaction open when the key is taken.
CREATE VIEW IF NOT EXISTS axum_idempotency_claim_v1 (key_digest, now_millis) AS
    SELECT NULL, NULL WHERE 0;
CREATE TRIGGER IF NOT EXISTS axum_idempotency_claim_v1_refuse_live
    INSTEAD OF INSERT ON axum_idempotency_claim_v1
BEGIN
    SELECT RAISE(ROLLBACK, 'axum_idempotency: a live record holds the key')
    WHERE EXISTS (SELECT 1 FROM idempotency_records
                  WHERE key_digest = NEW.key_digest AND expires_at > NEW.now_millis);
END;
