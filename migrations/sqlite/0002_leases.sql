-- axum-idempotency schema version 2 (SQLite): leases for claims that outlive one transaction.
ALTER TABLE idempotency_records ADD COLUMN lease_owner BLOB;
ALTER TABLE idempotency_records ADD COLUMN lease_expires_at INTEGER;
