-- axum-idempotency store schema version 1 (MySQL 8 / MariaDB 10.6+): the records, the inbox's
-- dedupe keys, and the procedure a new key's claim is a call of.
-- MySQL commits DDL implicitly, so this script must be safe to run twice (IF NOT EXISTS, indexes
-- declared inline: MySQL 8 has no CREATE INDEX IF NOT EXISTS; DROP PROCEDURE IF EXISTS).

-- Records live in their own table, keyed by the SHA-256 of the scoped key; the raw key is never
-- stored. The lease columns serve claims that outlive one transaction.
-- headers and body are LONGBLOB (up to 4 GiB): a MEDIUMBLOB stops at 16 MiB, below what
-- `max_response_body` may be configured to, and costs the same per row. The practical ceiling
-- is the server's max_allowed_packet, which must exceed the largest response stored.
-- utf8mb4_bin compares text byte for byte, the same on MySQL 8 and MariaDB whatever their defaults.
CREATE TABLE IF NOT EXISTS idempotency_records (
    key_digest  BINARY(32)  NOT NULL PRIMARY KEY,
    principal   TEXT,
    method      TEXT        NOT NULL,
    route       TEXT        NOT NULL,
    fingerprint BINARY(32)  NOT NULL,
    state       VARCHAR(32) NOT NULL,
    status      INT,
    headers     LONGBLOB,
    body        LONGBLOB,
    created_at  BIGINT      NOT NULL,
    expires_at  BIGINT      NOT NULL,
    lease_owner      BINARY(16),
    lease_expires_at BIGINT,
    INDEX idempotency_records_expires_at (expires_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- The inbox's dedupe keys. An inbox never replays a stored response: a key it finds claimed is a
-- duplicate, whatever the record says. So its claim keeps only the key's digest and when the key
-- expires, and is one insert in the handler's transaction, where the primary key decides, as a
-- hand-written dedupe table's would: no procedure, and no second write at commit.
CREATE TABLE IF NOT EXISTS idempotency_inbox (
    key_digest BINARY(32) NOT NULL PRIMARY KEY,
    expires_at BIGINT     NOT NULL,
    INDEX idempotency_inbox_expires_at (expires_at)
) ENGINE = InnoDB;

-- A claim that begins its transaction. The layer calls this procedure instead of sending BEGIN,
-- so a new key's claim costs no exchange with the server beyond the transaction's own. It starts
-- the transaction and inserts the key's row in flight ('processing', no response): the primary
-- key decides, and only when the key already has a row does it look at that row: a live record
-- refuses the claim, an expired one is replaced under its row lock. It takes no state or
-- response: every claim is followed by the record's UPDATE, which writes them before the
-- transaction commits, and each value a call carries costs the server a variable to set up. A
-- claimer of a key another transaction holds waits on the insert, and a Galera cluster certifies
-- the row.
-- It returns with the transaction open and the key held, or rolls back and signals, so no
-- transaction is left open: SQLSTATE 45I01 means "taken", any other error is the server's own
-- (1205 lock wait timeout, 1213 deadlock), passed on unchanged. The session's
-- innodb_lock_wait_timeout is set to the caller's bound for the claim alone and restored before
-- the procedure returns, whatever its outcome.
-- The name carries a version: a later schema version that changes the claim adds a procedure
-- under a new name beside this one, so instances still running the older code keep calling
-- theirs during a rolling upgrade. Creating it needs the CREATE ROUTINE privilege, calling it
-- EXECUTE (both part of ALL on the database).
-- Parameters are declared utf8mb4 so that a principal or route survives whatever the database's
-- default character set is.
DROP PROCEDURE IF EXISTS axum_idempotency_claim_v1;
CREATE PROCEDURE axum_idempotency_claim_v1(
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
