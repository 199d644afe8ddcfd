-- axum-idempotency schema version 2 (PostgreSQL): leases for claims that outlive one transaction.
ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS lease_owner BYTEA;
ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS lease_expires_at BIGINT;
