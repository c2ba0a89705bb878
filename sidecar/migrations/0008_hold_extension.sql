-- Hold extension: the terms a fallback decides on gain how far an extension may
-- move a hold (NULL in a row written before: holdSeconds, so no extension).
ALTER TABLE stock ADD COLUMN max_hold_seconds BIGINT;
