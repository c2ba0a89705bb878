-- The attempt that made the change numbered `seq` when it was a confirm, cancel or
-- extension prepared in Redis (NULL otherwise: admissions, expiries, the fallback's
-- changes, and rows from before this column). A check of Redis against the ledger
-- (after any Redis failure or reconnect) takes a change prepared there under that
-- number for the ledger's only when the attempts match: a promoted replica hands a
-- lost change's number out again, to another attempt. A change prepared before
-- this column and still unfinished therefore reads as behind, and costs one
-- rebuild.
ALTER TABLE reservations ADD COLUMN changed_by TEXT;
