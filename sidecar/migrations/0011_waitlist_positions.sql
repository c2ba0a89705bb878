-- The highest position a drop's lines handed out, read by every check of Redis
-- against the ledger (a Redis that lost joins is behind the ledger).
CREATE INDEX waitlist_position ON waitlist (drop_key, position);
