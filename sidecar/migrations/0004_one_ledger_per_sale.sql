-- One ledger per sale, the newest config on the fallback, changes with deadlines.

-- The newest config of the drop that any sidecar sharing this ledger has read
-- (generation-ordered with the limit): the fallback gate decides on it, so a limit
-- cut, an endsAt in the past or a pause published by the operator is obeyed even by
-- a sidecar whose own copy is older.
ALTER TABLE stock ADD COLUMN starts_at_ms BIGINT;
ALTER TABLE stock ADD COLUMN ends_at_ms BIGINT;
ALTER TABLE stock ADD COLUMN per_user_limit BIGINT;
ALTER TABLE stock ADD COLUMN hold_seconds BIGINT;

-- The attempt that wrote a reservation's row. A row in state 'abandoned' is no
-- reservation: the claim of an admission judged dead before it was recorded, so
-- that its own late commit is refused; another attempt of the key replaces it.
ALTER TABLE reservations ADD COLUMN attempt TEXT;
-- A confirm or cancel judged dead before it was recorded: its late commit (this
-- attempt) is refused.
ALTER TABLE reservations ADD COLUMN fenced_attempt TEXT;

-- The ledger each sale this ledger's sidecars met is recorded by, as Redis named it
-- (its `ledger` key): when it is this ledger, the sale may fall back to it while
-- Redis cannot be asked; either way it is written back into a Redis that lost it,
-- so that no ledger new to the sale can take it over.
CREATE TABLE sales (
    drop_key    TEXT   NOT NULL PRIMARY KEY,
    ledger_id   TEXT   NOT NULL,
    noted_at_ms BIGINT NOT NULL
);

-- Replaced by the sale's one ledger.
DROP TABLE ledger_peers;
