-- Sales that are over (their drop deleted, or its config naming another sale), and
-- since when: the ledger forgets them `--ledger-retention` later (see
-- ledger::retention).
CREATE TABLE ended_sales (
    drop_key    TEXT   NOT NULL PRIMARY KEY,
    ended_at_ms BIGINT NOT NULL
);
