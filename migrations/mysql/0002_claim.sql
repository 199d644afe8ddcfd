-- axum-idempotency schema version 2 (MySQL 8 / MariaDB 10.6+): a claim that begins its transaction.
-- The layer calls this procedure instead of sending BEGIN, so a new key's claim costs no exchange
-- with the server beyond the transaction's own. It starts the transaction, claims the key exactly as
-- a plain claim does (the primary key decides; an expired record is replaced under its row lock),
-- and returns with the transaction open and the key held. When a live record holds the key, or the
-- wait for a concurrent claim runs out, it rolls back and signals, so no transaction is left open:
-- SQLSTATE 45I01 means "taken", any other error is the server's own (1205 lock wait timeout, 1213
-- deadlock), passed on unchanged.
-- The session's innodb_lock_wait_timeout is set to the caller's bound for the claim alone and
-- restored before the procedure returns, whatever its outcome.
-- LAST_INSERT_ID is the outcome: the table has no AUTO_INCREMENT, so it stays 0 unless the update
-- clause sets it, which it does only when it leaves a live record alone.
-- The name carries a version: a later schema version adds a new procedure rather than changing this
-- one under instances that still call it. Creating it needs the CREATE ROUTINE privilege, calling
-- it EXECUTE (both part of ALL on the database).
-- Parameters are declared utf8mb4 so that a principal or route survives whatever the database's
-- default character set is.
DROP PROCEDURE IF EXISTS axum_idempotency_claim_v1;
CREATE PROCEDURE axum_idempotency_claim_v1(
    IN new_key_digest       BINARY(32),
    IN new_principal        TEXT CHARACTER SET utf8mb4,
    IN new_method           TEXT CHARACTER SET utf8mb4,
    IN new_route            TEXT CHARACTER SET utf8mb4,
    IN new_fingerprint      BINARY(32),
    IN new_state            VARCHAR(32) CHARACTER SET utf8mb4,
    IN new_status           INT,
    IN new_headers          LONGBLOB,
    IN new_body             LONGBLOB,
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
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        SET SESSION innodb_lock_wait_timeout = saved_lock_wait;
        RESIGNAL;
    END;
    SET SESSION innodb_lock_wait_timeout = lock_wait_seconds;
    START TRANSACTION;
    DO LAST_INSERT_ID(0);
    INSERT INTO idempotency_records
        (key_digest, principal, method, route, fingerprint, state, status, headers, body,
         created_at, expires_at, lease_owner, lease_expires_at)
    VALUES
        (new_key_digest, new_principal, new_method, new_route, new_fingerprint, new_state,
         new_status, new_headers, new_body, new_created_at, new_expires_at, new_lease_owner,
         new_lease_expires_at)
    ON DUPLICATE KEY UPDATE
        principal = IF(expires_at <= new_created_at, new_principal, principal),
        method = IF(expires_at <= new_created_at, new_method, method),
        route = IF(expires_at <= new_created_at, new_route, route),
        fingerprint = IF(expires_at <= new_created_at, new_fingerprint, fingerprint),
        state = IF(expires_at <= new_created_at, new_state, state),
        status = IF(expires_at <= new_created_at, new_status, status),
        headers = IF(expires_at <= new_created_at, new_headers, headers),
        body = IF(expires_at <= new_created_at, new_body, body),
        created_at = IF(expires_at <= new_created_at, new_created_at, created_at),
        lease_owner = IF(expires_at <= new_created_at, new_lease_owner, lease_owner),
        lease_expires_at = IF(expires_at <= new_created_at, new_lease_expires_at, lease_expires_at),
        expires_at = IF(expires_at <= new_created_at, new_expires_at, LAST_INSERT_ID(expires_at));
    SET SESSION innodb_lock_wait_timeout = saved_lock_wait;
    IF LAST_INSERT_ID() <> 0 THEN
        SIGNAL SQLSTATE '45I01'
            SET MESSAGE_TEXT = 'axum_idempotency: a live record holds the key';
    END IF;
END;
