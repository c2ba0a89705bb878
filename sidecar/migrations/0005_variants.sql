-- Variants (sizes) of a drop: the variant a reservation holds units of ('' for a
-- drop without variants), and each variant's stock beside the drop's own row in
-- `stock`, kept in step by the same changes: limit minus what the variant's active
-- or confirmed reservations hold. A variant's limit moves, like the drop's, only
-- with a newer generation of the drop.
ALTER TABLE reservations ADD COLUMN variant TEXT NOT NULL DEFAULT '';

CREATE TABLE variant_stock (
    drop_key   TEXT   NOT NULL,
    variant    TEXT   NOT NULL,
    lim        BIGINT NOT NULL,
    available  BIGINT NOT NULL,
    generation BIGINT NOT NULL,
    PRIMARY KEY (drop_key, variant)
);
