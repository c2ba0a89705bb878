-- The dropgate ledger. One schema for SQLite and PostgreSQL: only types and
-- statements both understand.

-- Every reservation either path admitted, and its state.
CREATE TABLE reservations (
    drop_key      TEXT    NOT NULL,  -- namespace/name
    res_key       TEXT    NOT NULL,  -- the idempotency key
    user_id       TEXT    NOT NULL,
    quantity      BIGINT  NOT NULL,
    state         TEXT    NOT NULL,  -- active | confirmed | cancelled | expired
    path          TEXT    NOT NULL,  -- gate | fallback: who admitted it
    expires_at_ms BIGINT  NOT NULL,
    updated_at_ms BIGINT  NOT NULL,
    replayed      BIGINT  NOT NULL,  -- 0: a fallback change Redis has not seen yet
    PRIMARY KEY (drop_key, res_key)
);
CREATE INDEX reservations_to_replay ON reservations (drop_key, replayed);
CREATE INDEX reservations_due ON reservations (drop_key, state, expires_at_ms);

-- The fallback gate's stock: limit minus what is active or confirmed, kept in step
-- by every recorded change, whichever path made it.
CREATE TABLE stock (
    drop_key  TEXT   NOT NULL PRIMARY KEY,
    lim       BIGINT NOT NULL,
    available BIGINT NOT NULL
);

-- Units each user holds, for the fallback gate's per-user limit.
CREATE TABLE buyers (
    drop_key TEXT   NOT NULL,
    user_id  TEXT   NOT NULL,
    held     BIGINT NOT NULL,
    PRIMARY KEY (drop_key, user_id)
);

-- The transactional outbox: written with the change it announces.
CREATE TABLE outbox (
    id            BIGINT NOT NULL PRIMARY KEY,
    event_id      TEXT   NOT NULL UNIQUE,
    drop_key      TEXT   NOT NULL,
    payload       TEXT   NOT NULL,
    created_at_ms BIGINT NOT NULL,
    sent_at_ms    BIGINT
);
CREATE INDEX outbox_pending ON outbox (sent_at_ms, id);

-- Counters handed out inside transactions (outbox ids), portable where
-- autoincrement is not.
CREATE TABLE sequences (
    name       TEXT   NOT NULL PRIMARY KEY,
    next_value BIGINT NOT NULL
);
INSERT INTO sequences (name, next_value) VALUES ('outbox', 0);

-- The highest fence each lock handed out: fences keep growing across a Redis
-- failover that lost the counter.
CREATE TABLE lock_fences (
    lock_name TEXT   NOT NULL PRIMARY KEY,
    fence     BIGINT NOT NULL
);

-- Storage guarded by fencing tokens: a write carrying a lower fence than the last
-- accepted one is refused.
CREATE TABLE fenced_writes (
    resource TEXT   NOT NULL PRIMARY KEY,
    fence    BIGINT NOT NULL,
    value    TEXT   NOT NULL
);

-- Events a consumer has applied, written in the same transaction as the effect.
CREATE TABLE processed_events (
    consumer TEXT NOT NULL,
    event_id TEXT NOT NULL,
    PRIMARY KEY (consumer, event_id)
);
