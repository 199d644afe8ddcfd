-- axum-idempotency schema version 3 (PostgreSQL): the claim and the finish as functions.
-- The layer sends a new key's claim with BEGIN and the response record with COMMIT, each in one
-- exchange. Written as plain statements, the server parses and plans them again on every request;
-- as functions, PL/pgSQL keeps their plans for the session and the layer's message is one call.
-- Both do exactly what the plain statements do: the primary key decides a claim, an expired record
-- is replaced under its row lock, a live one is left alone.
-- The names carry a version: a later schema version adds new functions rather than changing these
-- under instances that still call them. They run with the caller's rights (SECURITY INVOKER) and
-- resolve the table through the caller's search_path, like the layer's other statements.

-- Claims a key inside the transaction its caller is in. Every claim of a key first takes the key's
-- advisory lock (lock_number). Free, it means no other transaction is claiming the key, so the
-- insert cannot queue behind an uncommitted claim and the session's settings stay as they are.
-- Held, an in-flight claim has it: the wait for it and for the row is bounded by lock_wait, set
-- for the claim alone and restored before the function returns. When a live record holds the key
-- it raises unique_violation on the primary key, the error a plain insert of the key would give.
CREATE OR REPLACE FUNCTION axum_idempotency_claim_v1(
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
    new_lease_expires_at BIGINT,
    lock_number          BIGINT,
    lock_wait            TEXT
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
        PERFORM set_config('lock_timeout', lock_wait, true);
        PERFORM pg_advisory_xact_lock(lock_number);
    END IF;
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
    IF saved_lock_timeout IS NOT NULL THEN
        PERFORM set_config('lock_timeout', saved_lock_timeout, true);
    END IF;
END;
$$;

-- Writes a finished record's outcome; its caller commits.
CREATE OR REPLACE FUNCTION axum_idempotency_finish_v1(
    target_key_digest BYTEA,
    new_state         TEXT,
    new_status        INTEGER,
    new_headers       BYTEA,
    new_body          BYTEA
) RETURNS VOID
LANGUAGE plpgsql
VOLATILE
SECURITY INVOKER
AS $$
BEGIN
    UPDATE idempotency_records
        SET state = new_state, status = new_status, headers = new_headers, body = new_body
        WHERE key_digest = target_key_digest;
END;
$$;
