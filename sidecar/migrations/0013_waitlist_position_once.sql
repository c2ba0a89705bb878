-- Each place in a drop's lines is handed out once: Redis numbers joins, and a
-- promoted replica that lost a join hands its position out again. The ledger
-- refuses a second join of a position, as it refuses a change number handed out
-- twice, and the sidecar rebuilds Redis from the ledger (the join the ledger kept
-- would otherwise be lost from the line for good). A join given up on before it
-- was written (abandoned) holds no place.
CREATE UNIQUE INDEX waitlist_position_once ON waitlist (drop_key, position)
    WHERE state <> 'abandoned';
