-- The attempt that made the change numbered `seq` when it was a confirm, cancel or
-- extension prepared in Redis (NULL otherwise, and for rows from before this
-- column). A check of Redis after a failover takes a change prepared there under
-- that number for the ledger's only when the attempts match: a promoted replica
-- hands a lost change's number out again, to another attempt.
ALTER TABLE reservations ADD COLUMN changed_by TEXT;
