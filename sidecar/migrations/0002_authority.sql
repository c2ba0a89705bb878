-- One authority at a time for a drop's stock, lost-write detection, sale identity.
-- Drop keys are `namespace/name/sale` from here on: a drop re-created under the
-- same name is a new sale with rows of its own.

-- Who decides admissions for a drop: 'gate' (Redis, at this epoch), 'ledger' (the
-- fallback gate), or 'replaying' (nobody: Redis is being brought in line with the
-- ledger before the gate opens at this epoch). Every durable admission checks this
-- row in its own transaction, so a sidecar acting on a stale view is refused.
CREATE TABLE authority (
    drop_key      TEXT   NOT NULL PRIMARY KEY,
    holder        TEXT   NOT NULL,
    epoch         BIGINT NOT NULL,
    changed_at_ms BIGINT NOT NULL
);

-- When each sidecar last reached Redis for a drop on the gate: the ledger is taken
-- over for a Redis outage only when no sidecar has reached Redis for a while, so one
-- sidecar's partition does not move everyone off the gate.
CREATE TABLE gate_seen (
    drop_key   TEXT   NOT NULL,
    sidecar    TEXT   NOT NULL,
    seen_at_ms BIGINT NOT NULL,
    PRIMARY KEY (drop_key, sidecar)
);

-- Other ledgers seen serving a drop (per-pod ledgers): with any, this ledger does
-- not hold the whole sale, and its fallback gate would oversell.
CREATE TABLE ledger_peers (
    drop_key  TEXT NOT NULL,
    ledger_id TEXT NOT NULL,
    PRIMARY KEY (drop_key, ledger_id)
);

-- This ledger's identity, made on first open.
CREATE TABLE ledger_meta (
    name  TEXT NOT NULL PRIMARY KEY,
    value TEXT NOT NULL
);

-- The limit in the stock row moves only with a newer generation of the drop, so a
-- sidecar with a stale config cannot write an old limit back.
ALTER TABLE stock ADD COLUMN generation BIGINT NOT NULL DEFAULT 0;

-- Redis's number for each change the gate made: a number recorded twice means Redis
-- lost writes and handed it out again.
ALTER TABLE reservations ADD COLUMN seq BIGINT;
CREATE INDEX reservations_seq ON reservations (drop_key, seq);
ALTER TABLE outbox ADD COLUMN seq BIGINT;
CREATE UNIQUE INDEX outbox_seq ON outbox (drop_key, seq);
