-- axum-idempotency store schema version 1 (PostgreSQL): the records, the inbox's dedupe keys,
-- and the two procedures a new key's claim and record are calls of.

-- Records live in their own table, keyed by the SHA-256 of the scoped key; the raw key is never
-- stored. The lease columns serve claims that outlive one transaction.
CREATE TABLE IF NOT EXISTS idempotency_records (
    key_digest       BYTEA   PRIMARY KEY,
    principal        TEXT,
    method           TEXT    NOT NULL,
    route            TEXT    NOT NULL,
    fingerprint      BYTEA   NOT NULL,
    state            TEXT    NOT NULL,
    status           INTEGER,
    headers          BYTEA,
    body             BYTEA,
    created_at       BIGINT  NOT NULL,
    expires_at       BIGINT  NOT NULL,
    lease_owner      BYTEA,
    lease_expires_at BIGINT
);
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);

-- The inbox's dedupe keys. An inbox never replays a stored response: a key it finds claimed is a
-- duplicate, whatever the record says. So its claim keeps only the key's digest and when the key
-- expires, and is one plain insert in the handler's transaction, where the primary key decides,
-- as a hand-written dedupe table's would: no procedure, no advisory lock, no read of the key
-- first, and no second write at commit. A concurrent delivery of the key waits on the first's
-- index entry.
-- The expiry index is a BRIN: keys are inserted in the order they expire (one retention per
-- inbox), so a block range summary finds the expired ones for the purge, at almost no cost per
-- insert, where a B-tree would add a second index entry to every claim.
CREATE TABLE IF NOT EXISTS idempotency_inbox (
    key_digest BYTEA  PRIMARY KEY,
    expires_at BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_inbox_expires_at ON idempotency_inbox USING brin (expires_at);

-- A new key's claim is sent with BEGIN and its record with COMMIT, each as one CALL: written as
-- plain statements, the server would parse and plan them on every request, while PL/pgSQL keeps
-- their plans for the session, and CALL, unlike SELECT of a function, is not planned itself.
-- Neither procedure controls the transaction, so both run inside the caller's (CALL before BEGIN
-- runs in the implicit transaction that BEGIN then continues). Every claimer of a key takes the
-- key's advisory lock, so the key's transactions run one at a time; the primary key still has the
-- last word.
-- The names carry a version: a later schema version that changes a procedure adds one under a new
-- name beside it, so instances still running the older code keep calling theirs during a rolling
-- upgrade. Both run with the caller's rights (SECURITY INVOKER) and resolve the table through the
-- caller's search_path, like the layer's other statements.

-- Takes the key's advisory lock for the caller's transaction and raises unique_violation on the
-- primary key when a live record holds the key; an expired record under the key is deleted, in the
-- caller's transaction, so the record can be inserted plainly. The lock is taken at once when
-- free, else waited for with the wait bounded by lock_wait_ms milliseconds (at least 1: 0 would
-- mean "wait forever"), set as lock_timeout for the wait alone. Under READ COMMITTED the read after
-- the wait sees what the lock's previous holder committed. Under REPEATABLE READ and SERIALIZABLE
-- the transaction's snapshot predates the wait and cannot, so a claim that had to wait raises
-- serialization_failure instead: its caller runs it again in a new transaction, which sees.
CREATE OR REPLACE PROCEDURE axum_idempotency_lock_v1(
    target_key_digest BYTEA,
    now_millis        BIGINT,
    lock_number       BIGINT,
    lock_wait_ms      BIGINT
)
LANGUAGE plpgsql
SECURITY INVOKER
AS $$
DECLARE
    -- Advisory locks belong to the whole database: the table's oid in the number keeps the
    -- keys of two schemas (two apps, two tenants) from waiting for each other.
    table_lock_number  BIGINT := lock_number # ('idempotency_records'::regclass::oid::BIGINT << 32);
    saved_lock_timeout TEXT;
    found_expires_at   BIGINT;
BEGIN
    IF NOT pg_try_advisory_xact_lock(table_lock_number) THEN
        saved_lock_timeout := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', greatest(lock_wait_ms, 1) || 'ms', true);
        PERFORM pg_advisory_xact_lock(table_lock_number);
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
CREATE OR REPLACE PROCEDURE axum_idempotency_record_v1(
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
