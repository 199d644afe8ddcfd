-- axum-idempotency schema version 5 (PostgreSQL): the record is a plain insert, and both steps are
-- procedures.
-- Version 4's record was an upsert that replaced an expired record under the key. Setting up the
-- upsert (its conflict arbiter, its update projection, its condition) was the largest part of the
-- server's work per new key. Here the claim, which already holds the key's lock and reads the
-- key's record, deletes a record it finds expired, and the record is inserted plainly: a live
-- record that somehow appeared meanwhile still fails the insert on the primary key, the same
-- error as before, and the transaction is run again.
-- Both are procedures, run by CALL: unlike SELECT of a function, CALL is not planned, which was
-- the next largest part of the work. Neither controls the transaction, so both run inside the
-- caller's (CALL before BEGIN runs in the implicit transaction that BEGIN then continues).
-- Version 4's functions stay for instances still running the older code during a rolling upgrade:
-- both versions take the same lock before touching a key, and a record either one writes is one
-- the other reads.

-- Takes the key's advisory lock for the caller's transaction, as axum_idempotency_lock_v1 does,
-- and raises unique_violation on the primary key when a live record holds the key. An expired
-- record under the key is deleted, in the caller's transaction, so the record can be inserted.
CREATE OR REPLACE PROCEDURE axum_idempotency_lock_v2(
    target_key_digest BYTEA,
    now_millis        BIGINT,
    lock_number       BIGINT,
    lock_wait_ms      BIGINT
)
LANGUAGE plpgsql
SECURITY INVOKER
AS $$
DECLARE
    saved_lock_timeout TEXT;
    found_expires_at   BIGINT;
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
    SELECT expires_at INTO found_expires_at FROM idempotency_records
        WHERE key_digest = target_key_digest;
    IF found_expires_at > now_millis THEN
        RAISE unique_violation USING
            MESSAGE = 'axum_idempotency: a live record holds the key',
            TABLE = 'idempotency_records',
            CONSTRAINT = 'idempotency_records_pkey';
    ELSIF FOUND THEN
        DELETE FROM idempotency_records WHERE key_digest = target_key_digest;
    END IF;
END;
$$;

-- Inserts a claimed key's record. A record under the key (live: the claim found none) fails the
-- insert with unique_violation on the primary key, so the caller's transaction is not committed.
CREATE OR REPLACE PROCEDURE axum_idempotency_record_v2(
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
)
LANGUAGE plpgsql
SECURITY INVOKER
AS $$
BEGIN
    INSERT INTO idempotency_records
        (key_digest, principal, method, route, fingerprint, state, status, headers, body,
         created_at, expires_at, lease_owner, lease_expires_at)
    VALUES
        (new_key_digest, new_principal, new_method, new_route, new_fingerprint, new_state,
         new_status, new_headers, new_body, new_created_at, new_expires_at, new_lease_owner,
         new_lease_expires_at);
END;
$$;
