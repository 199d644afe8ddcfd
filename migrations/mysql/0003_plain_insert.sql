-- axum-idempotency schema version 3 (MySQL 8 / MariaDB 10.6+): a new key's claim is a plain insert.
-- Version 2's claim was an upsert whose update clause held twelve conditional assignments. The
-- server set those up (resolved every column and condition) on each call, new key or not, and it
-- was the largest part of the server's work per new key. Here the claim inserts plainly, and only
-- when the key already has a row does it look at that row: a live record refuses the claim as
-- before, an expired one is replaced under its row lock. The claim writes the row in flight
-- ('processing', no response) and takes no state or response: every claim is followed by the
-- record's UPDATE, which writes them before the transaction commits, and each value a call
-- carries costs the server a variable to set up. The primary key still decides: a claimer
-- of a key another transaction holds waits on the insert, bounded as before, and a Galera cluster
-- still certifies the row.
-- Version 2's procedure stays for instances still running the older code during a rolling upgrade:
-- both write and lock the same row, so either one's claim waits for or refuses the other's.
-- Outcomes as version 2: returns with the transaction open and the key held, or rolls back and
-- signals SQLSTATE 45I01 ("taken") or passes the server's own error on (1205 lock wait timeout, 1213
-- deadlock), with the session's innodb_lock_wait_timeout restored whatever the outcome.
DROP PROCEDURE IF EXISTS axum_idempotency_claim_v2;
CREATE PROCEDURE axum_idempotency_claim_v2(
    IN new_key_digest       BINARY(32),
    IN new_principal        TEXT CHARACTER SET utf8mb4,
    IN new_method           TEXT CHARACTER SET utf8mb4,
    IN new_route            TEXT CHARACTER SET utf8mb4,
    IN new_fingerprint      BINARY(32),
    IN new_created_at       BIGINT,
    IN new_expires_at       BIGINT,
    IN new_lease_owner      BINARY(16),
    IN new_lease_expires_at BIGINT,
    IN lock_wait_seconds    BIGINT
)
MODIFIES SQL DATA
SQL SECURITY INVOKER
BEGIN
    DECLARE saved_lock_wait BIGINT DEFAULT @@SESSION.innodb_lock_wait_timeout;
    -- Also catches what the duplicate's handler below signals: a handler's own conditions go to
    -- the handlers of the blocks around its own.
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        SET SESSION innodb_lock_wait_timeout = saved_lock_wait;
        RESIGNAL;
    END;
    SET SESSION innodb_lock_wait_timeout = lock_wait_seconds;
    START TRANSACTION;
    BEGIN
        -- ER_DUP_ENTRY: the key has a row, committed (the insert waited for its writer if it
        -- had not) and not ours. Declared in a block of its own, where a flag and a test of it
        -- would cost every new key two more steps.
        DECLARE CONTINUE HANDLER FOR 1062
        BEGIN
            -- A plain read first: duplicates of a live key, the usual case, all refuse at once,
            -- where locking the row for an update would have them queue, and deadlock, on it.
            IF (SELECT expires_at FROM idempotency_records WHERE key_digest = new_key_digest)
                > new_created_at THEN
                SIGNAL SQLSTATE '45I01'
                    SET MESSAGE_TEXT = 'axum_idempotency: a live record holds the key';
            END IF;
            -- Expired when read: replaced only if it still is under the row's lock. A record
            -- purged or taken over meanwhile leaves nothing to replace, and the claim is
            -- refused: the caller reads the key again, and claims anew if it finds no record.
            UPDATE idempotency_records SET
                principal = new_principal, method = new_method, route = new_route,
                fingerprint = new_fingerprint, state = 'processing', status = NULL,
                headers = NULL, body = NULL, created_at = new_created_at,
                expires_at = new_expires_at, lease_owner = new_lease_owner,
                lease_expires_at = new_lease_expires_at
            WHERE key_digest = new_key_digest AND expires_at <= new_created_at;
            IF ROW_COUNT() = 0 THEN
                SIGNAL SQLSTATE '45I01'
                    SET MESSAGE_TEXT = 'axum_idempotency: a live record holds the key';
            END IF;
        END;
        INSERT INTO idempotency_records
            (key_digest, principal, method, route, fingerprint, state, created_at, expires_at,
             lease_owner, lease_expires_at)
        VALUES
            (new_key_digest, new_principal, new_method, new_route, new_fingerprint, 'processing',
             new_created_at, new_expires_at, new_lease_owner, new_lease_expires_at);
    END;
    SET SESSION innodb_lock_wait_timeout = saved_lock_wait;
END;
