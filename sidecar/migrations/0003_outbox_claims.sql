-- Sidecars sharing a ledger publish each event once: a dispatcher claims a batch of
-- pending events (claimed_by, until claimed_until_ms) before it publishes them, and
-- another dispatcher takes only unclaimed or lapsed ones.
ALTER TABLE outbox ADD COLUMN claimed_by TEXT;
ALTER TABLE outbox ADD COLUMN claimed_until_ms BIGINT;
