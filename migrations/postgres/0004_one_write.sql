-- axum-idempotency schema version 4 (PostgreSQL): a new key's record is written once, at COMMIT.
-- Version 3's claim inserted an in-flight row that the finish then updated: two writes and a dead
-- tuple per request. Here the claim only takes the key's advisory lock and reads; the complete
-- record is inserted by the statement that commits. Every claimer of a key takes the same lock, so
-- the key's transactions still run one at a time, and the primary key still decides: a record that
-- somehow appeared meanwhile fails the insert, and the transaction is run again.
-- Version 3's functions stay for instances still running the older code during a rolling upgrade:
-- both versions take the same lock before touching a key.

-- Takes the key's advisory lock for the caller's transaction and raises unique_violation on the
-- primary key when a live record holds the key. The lock is taken at once when free, else waited
-- for with the wait bounded by lock_wait_ms milliseconds (at least 1: 0 would mean "wait forever"),
-- set as lock_timeout for the wait alone. Under READ COMMITTED the read after the wait sees what
-- the lock's previous holder committed. Under REPEATABLE READ and SERIALIZABLE the transaction's
-- snapshot predates the wait and cannot, so a claim that had to wait raises serialization_failure
-- instead: its caller runs it again in a new transaction, which sees.
CREATE OR REPLACE FUNCTION axum_idempotency_lock_v1(
    target_key_digest BYTEA,
    now_millis        BIGINT,
    lock_number       BIGINT,
    lock_wait_ms      BIGINT
) RETURNS VOID
LANGUAGE plpgsql
VOLATILE
SECURITY INVOKER
AS $$
DECLARE
    saved_lock_timeout TEXT;
BEGIN
    IF NOT pg_try_advisory_xact_lock(lock_number) THEN
        saved_lock_timeout := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', greatest(lock_wait_ms, 1) || 'ms', true);
        PERFORM pg_advisory_xact_lock(lock_number);
        PERFORM set_config('lock_timeout', saved_lock_timeout, true);
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            RAISE serialization_failure USING
                MESSAGE = 'axum_idempotency: the key was claimed meanwhile; run again';
        END IF;
    END IF;
    IF EXISTS (SELECT 1 FROM idempotency_records
               WHERE key_digest = target_key_digest AND expires_at > now_millis) THEN
        RAISE unique_violation USING
            MESSAGE = 'axum_idempotency: a live record holds the key',
            TABLE = 'idempotency_records',
            CONSTRAINT = 'idempotency_records_pkey';
    END IF;
END;
$$;

-- Writes a claimed key's record: inserts it, or replaces an expired record under the same key. A
-- live record under the key raises unique_violation on the primary key, the error a plain insert
-- would give, so the caller's transaction is not committed.
CREATE OR REPLACE FUNCTION axum_idempotency_record_v1(
    new_key_digest       BYTEA,
    new_principal        TEXT,
    new_method           TEXT,
    new_route            TEXT,
    new_fingerprint      BYTEA,
    new_state            TEXT,
    new_status           INTEGER,
    new_headers          BYTEA,
    new_body             BYTEA,
    new_created_at       BIGINT,
    new_expires_at       BIGINT,
    new_lease_owner      BYTEA,
    new_lease_expires_at BIGINT
) RETURNS VOID
LANGUAGE plpgsql
VOLATILE
SECURITY INVOKER
AS $$
BEGIN
    INSERT INTO idempotency_records AS r
        (key_digest, principal, method, route, fingerprint, state, status, headers, body,
         created_at, expires_at, lease_owner, lease_expires_at)
    VALUES
        (new_key_digest, new_principal, new_method, new_route, new_fingerprint, new_state,
         new_status, new_headers, new_body, new_created_at, new_expires_at, new_lease_owner,
         new_lease_expires_at)
    ON CONFLICT (key_digest) DO UPDATE SET
        principal = EXCLUDED.principal, method = EXCLUDED.method, route = EXCLUDED.route,
        fingerprint = EXCLUDED.fingerprint, state = EXCLUDED.state, status = EXCLUDED.status,
        headers = EXCLUDED.headers, body = EXCLUDED.body, created_at = EXCLUDED.created_at,
        expires_at = EXCLUDED.expires_at, lease_owner = EXCLUDED.lease_owner,
        lease_expires_at = EXCLUDED.lease_expires_at
        WHERE r.expires_at <= EXCLUDED.created_at;
    IF NOT FOUND THEN
        RAISE unique_violation USING
            MESSAGE = 'axum_idempotency: a live record holds the key',
            TABLE = 'idempotency_records',
            CONSTRAINT = 'idempotency_records_pkey';
    END IF;
END;
$$;
