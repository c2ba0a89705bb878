-- The waitlist's lines: one row per entry, in the order of `position` (the order
-- the entries joined in Redis). A rebuild of Redis puts the line back from here.
CREATE TABLE waitlist (
    drop_key      TEXT   NOT NULL,  -- namespace/name/sale
    res_key       TEXT   NOT NULL,  -- the entry's idempotency key
    user_id       TEXT   NOT NULL,
    quantity      BIGINT NOT NULL,
    variant       TEXT,
    position      BIGINT NOT NULL,
    state         TEXT   NOT NULL,  -- waiting | offered | left | abandoned
    attempt       TEXT   NOT NULL,  -- the join's (abandoned: the join given up on)
    joined_at_ms  BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    PRIMARY KEY (drop_key, res_key)
);
CREATE INDEX waitlist_line ON waitlist (drop_key, state, variant, position);
CREATE INDEX waitlist_buyer ON waitlist (drop_key, user_id, state);
