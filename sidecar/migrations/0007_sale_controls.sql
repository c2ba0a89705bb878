-- Sale controls: the terms a fallback admission is decided on gain the pause
-- (NULL in a row written before: not paused), and a reservation keeps when it was
-- admitted (a buyer's look-up lists newest first; NULL for rows written before:
-- their last change's time is taken instead).
ALTER TABLE stock ADD COLUMN paused BIGINT;
ALTER TABLE reservations ADD COLUMN admitted_at_ms BIGINT;
-- A buyer's reservations on the fallback path.
CREATE INDEX reservations_by_buyer ON reservations (drop_key, user_id);
