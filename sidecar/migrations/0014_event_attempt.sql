-- The attempt of the change that wrote the event, where it has one (the fallback
-- gate's confirms and cancels always do; NULL for rows from before this column).
-- An event's id names the reservation and the change's kind, so a second
-- cancel of one reservation writes none: a cancel whose COMMIT went unanswered
-- takes the event as its own only when it carries its attempt, not a duplicate's
-- that landed instead.
ALTER TABLE outbox ADD COLUMN attempt TEXT;
