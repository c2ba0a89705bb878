// A shop's checkout against the dropgate sidecar (see ../README.md): one
// idempotency key per checkout attempt, 503 retried after Retry-After with jitter
// and the same key, confirm after payment, cancel when payment fails, answers read
// by `outcome`.

import { randomUUID } from "node:crypto";

const base = process.env.DROPGATE_URL ?? "http://127.0.0.1:7070";
const drop = process.env.DROP ?? "sale";
const buyers = Number(process.env.BUYERS ?? "10");
const prefix = process.env.PREFIX ?? "ts";

/** Every dropgate answer has an outcome; refusals say why in message. */
interface Answer {
  outcome: string;
  message?: string;
  [field: string]: unknown;
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/** POSTs body to path; a 503 is sent again, same body (same key), after its
 * Retry-After plus up to 250 ms of jitter. */
async function call(path: string, body: object): Promise<Answer> {
  for (let attempt = 1; ; attempt++) {
    const response = await fetch(base + path, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(body),
    });
    const answer = (await response.json()) as Answer;
    // Only a 503 with Retry-After asks for the same request again; one without it
    // says why in its message and is not to be sent again as it is.
    const retryAfter = response.headers.get("retry-after");
    if (response.status !== 503 || retryAfter === null || attempt === 30) {
      return answer;
    }
    const wait = Number(retryAfter);
    await sleep(wait * 1000 + Math.random() * 250);
  }
}

/** The shop's payment: here every third buyer's card is declined. */
function pay(buyer: number): boolean {
  return buyer % 3 !== 2;
}

async function checkout(buyer: number): Promise<string> {
  const user = `${prefix}-buyer-${buyer}`;
  const key = randomUUID(); // one checkout attempt, kept across retries
  const path = `/v1/drops/${encodeURIComponent(drop)}/reservations`;
  const reserved = await call(path, { key, user, quantity: 1 });
  // A hold: `admitted`, or a retry's `already_reserved` of a reservation still active.
  const held =
    reserved.outcome === "admitted" ||
    (reserved.outcome === "already_reserved" && reserved.state === "active");
  if (!held) {
    return reserved.outcome; // sold_out, per_user_limit_exceeded, ...
  }
  const reservation = `${path}/${encodeURIComponent(key)}`;
  if (pay(buyer)) {
    const confirmed = await call(`${reservation}/confirm`, { user });
    return confirmed.outcome === "already_confirmed" ? "confirmed" : confirmed.outcome;
  }
  const cancelled = await call(`${reservation}/cancel`, { user });
  return cancelled.outcome === "already_cancelled" ? "cancelled" : cancelled.outcome;
}

async function main() {
  const outcomes = await Promise.all(Array.from({ length: buyers }, (_, i) => checkout(i)));
  const seen: Record<string, number> = {};
  for (const outcome of outcomes) {
    seen[outcome] = (seen[outcome] ?? 0) + 1;
  }
  console.log(JSON.stringify({ client: "typescript", outcomes: seen }));
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
