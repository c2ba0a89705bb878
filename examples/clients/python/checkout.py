"""A shop's checkout against the dropgate sidecar (see ../README.md): one
idempotency key per checkout attempt, 503 retried after Retry-After with jitter and
the same key, confirm after payment, cancel when payment fails, answers read by
`outcome`."""

import json
import os
import random
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import requests

BASE = os.environ.get("DROPGATE_URL", "http://127.0.0.1:7070")
DROP = os.environ.get("DROP", "sale")
BUYERS = int(os.environ.get("BUYERS", "10"))
PREFIX = os.environ.get("PREFIX", "py")


def call(session: requests.Session, path: str, body: dict) -> dict:
    """POSTs body to path; a 503 is sent again, same body (same key), after its
    Retry-After plus up to 250 ms of jitter."""
    for attempt in range(1, 31):
        response = session.post(BASE + path, json=body, timeout=10)
        answer = response.json()  # every answer has "outcome"
        # Only a 503 with Retry-After asks for the same request again; one without
        # it says why in its message and is not to be sent again as it is.
        retry_after = response.headers.get("Retry-After")
        if response.status_code != 503 or retry_after is None or attempt == 30:
            return answer
        wait = float(retry_after)
        time.sleep(wait + random.uniform(0, 0.25))
    raise AssertionError("unreachable")


def pay(buyer: int) -> bool:
    """The shop's payment: here every third buyer's card is declined."""
    return buyer % 3 != 2


def checkout(buyer: int) -> str:
    user = f"{PREFIX}-buyer-{buyer}"
    key = str(uuid.uuid4())  # one checkout attempt, kept across retries
    path = f"/v1/drops/{quote(DROP, safe='')}/reservations"
    with requests.Session() as session:
        reserved = call(session, path, {"key": key, "user": user, "quantity": 1})
        # A hold: `admitted`, or a retry's `already_reserved` of a reservation still active.
        held = reserved["outcome"] == "admitted" or (
            reserved["outcome"] == "already_reserved" and reserved.get("state") == "active"
        )
        if not held:
            return reserved["outcome"]  # sold_out, per_user_limit_exceeded, ...
        reservation = f"{path}/{quote(key, safe='')}"
        if pay(buyer):
            outcome = call(session, reservation + "/confirm", {"user": user})["outcome"]
            return "confirmed" if outcome == "already_confirmed" else outcome
        outcome = call(session, reservation + "/cancel", {"user": user})["outcome"]
        return "cancelled" if outcome == "already_cancelled" else outcome


def main() -> None:
    with ThreadPoolExecutor(max_workers=BUYERS) as pool:
        outcomes = Counter(pool.map(checkout, range(BUYERS)))
    print(json.dumps({"client": "python", "outcomes": dict(outcomes)}))


if __name__ == "__main__":
    main()
