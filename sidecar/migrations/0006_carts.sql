-- Carts: one row per cart key of a namespace, written before the cart's first line
-- is held. Its lines are ordinary reservations of their drops (keys `<cart>:<n>`);
-- this row says what the cart asked (`terms`: its mode and added-up lines, as
-- canonical JSON, to tell a retry from a reuse of the key) and where the cart as a
-- whole stands. Every move is a compare-and-set on `state` (and `attempt`):
--   holding    a sidecar holds its lines, until deadline_ms;
--   held       answered 201: `held` lists the line numbers held, `short` the rest,
--              until expires_at_ms (its earliest line's deadline);
--   confirming a sidecar confirms its lines, until deadline_ms;
--   confirmed  every held line confirmed;
--   releasing  its lines are being given back, to end as `ends_as` (refused,
--              released, cancelled or expired); past deadline_ms anyone finishes;
--   refused    answered 409: nothing held, `short` says why for each line;
--   released   given back after its sidecar stopped mid-way: nothing held;
--   cancelled, expired: given back as a whole.
CREATE TABLE carts (
    namespace      TEXT   NOT NULL,
    cart_key       TEXT   NOT NULL,
    user_id        TEXT   NOT NULL,
    terms          TEXT   NOT NULL,
    state          TEXT   NOT NULL,
    ends_as        TEXT   NOT NULL DEFAULT '',
    attempt        TEXT   NOT NULL,
    deadline_ms    BIGINT NOT NULL,
    expires_at_ms  BIGINT NOT NULL DEFAULT 0,
    held           TEXT   NOT NULL DEFAULT '[]',
    short          TEXT   NOT NULL DEFAULT '[]',
    created_at_ms  BIGINT NOT NULL,
    PRIMARY KEY (namespace, cart_key)
);

CREATE INDEX carts_by_state ON carts (state, deadline_ms);
