"""A shop's consumer of a drop's events (docs/design.md, "Ledger and outbox";
sidecar/events.schema.json): applies each event's effect exactly once although the
stream delivers at least once.

The recipe:
  1. Read with a consumer group (XREADGROUP): an entry stays pending until XACK, so
     a consumer that dies mid-way gets it again, first thing, when it comes back
     under the same name; entries left idle by another name are claimed
     (XAUTOCLAIM, CLAIM_IDLE_MS).
  2. In ONE database transaction: record the event id in a processed-ids table and
     apply the effect. A redelivered (or republished) event's id is already there:
     the insert finds it and the effect is skipped.
  3. XACK only after that transaction committed.

The effect here is a tally of units per event type in SQLite (the shop's database
in real life: orders to ship, emails to send).

    REDIS_URL=redis://127.0.0.1:6379 STREAM='dropgate:{shop/sale}:events' \
      DATABASE=orders.db python3 consume.py

It reads until the stream has nothing new for a second, then exits (a service would
keep reading). CRASH_AFTER=n exits abruptly after n effects committed and before
their XACK: the next run gets them again and must skip them.
"""

import json
import os
import sqlite3

import redis

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
STREAM = os.environ["STREAM"]
DATABASE = os.environ.get("DATABASE", "orders.db")
GROUP = os.environ.get("GROUP", "orders")
CONSUMER = os.environ.get("CONSUMER", "orders-1")
CRASH_AFTER = int(os.environ.get("CRASH_AFTER", "0"))
# Entries another consumer of the group was given and has not acknowledged for this
# long (it died, or was renamed) are claimed by this one (XAUTOCLAIM).
CLAIM_IDLE_MS = int(os.environ.get("CLAIM_IDLE_MS", "60000"))

SCHEMA_VERSION = 1  # the payload version this consumer understands


def setup(db: sqlite3.Connection, r: redis.Redis) -> None:
    db.executescript(
        """
        CREATE TABLE IF NOT EXISTS processed_events (event_id TEXT PRIMARY KEY);
        CREATE TABLE IF NOT EXISTS tally (type TEXT PRIMARY KEY, events INTEGER, units INTEGER);
        """
    )
    try:
        # From the stream's start: a new consumer sees the whole history.
        r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def apply_once(db: sqlite3.Connection, event: dict) -> bool:
    """The effect and the processed id in one transaction; False for a duplicate."""
    if event.get("schemaVersion") != SCHEMA_VERSION:
        raise ValueError(f"event schemaVersion {event.get('schemaVersion')}: upgrade the consumer")
    # The connection is in autocommit mode (isolation_level=None): the transaction
    # is begun and ended here, explicitly, so both writes commit or neither does.
    db.execute("BEGIN IMMEDIATE")
    try:
        fresh = db.execute(
            "INSERT INTO processed_events (event_id) VALUES (?) ON CONFLICT DO NOTHING",
            (event["eventId"],),
        ).rowcount == 1
        if fresh:
            db.execute(
                "INSERT INTO tally (type, events, units) VALUES (?, 1, ?) "
                "ON CONFLICT (type) DO UPDATE SET events = events + 1, units = units + excluded.units",
                (event["type"], event["quantity"]),
            )
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return fresh


def main() -> None:
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    db = sqlite3.connect(DATABASE, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    setup(db, r)
    applied = skipped = 0
    # What another consumer of the group left unacknowledged for CLAIM_IDLE_MS (a pod
    # that died or came back under another name) becomes this one's pending entries;
    # otherwise they would stay pending for ever, and the stream is never trimmed
    # past an entry a group has not acknowledged.
    cursor = "0-0"
    while True:
        cursor, _claimed, *_ = r.xautoclaim(STREAM, GROUP, CONSUMER, CLAIM_IDLE_MS, cursor, count=100)
        if cursor == "0-0":
            break
    # "0" first: what was delivered to this consumer and never acknowledged (it
    # died before XACK, or claimed above); then ">" for what nobody was given yet.
    for start in ("0", ">"):
        while True:
            batch = r.xreadgroup(GROUP, CONSUMER, {STREAM: start}, count=50, block=1000)
            entries = batch[0][1] if batch else []
            if not entries:
                break
            for entry_id, fields in entries:
                if apply_once(db, json.loads(fields["payload"])):
                    applied += 1
                    if CRASH_AFTER and applied == CRASH_AFTER:
                        os._exit(3)  # committed, not acknowledged
                else:
                    skipped += 1
                r.xack(STREAM, GROUP, entry_id)
            if start == "0" and len(entries) < 50:
                break
    print(json.dumps({"applied": applied, "skipped": skipped}))


if __name__ == "__main__":
    main()
