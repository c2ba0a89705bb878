//! `POST /v1/drops/{drop}/reservations` and the reservation's confirm, cancel and
//! look-up: input parsed here, decided by the [service](crate::service), answered
//! here.

use std::sync::Arc;

use bytes::Bytes;
use warp::http::StatusCode;
use warp::reply::Response;

use super::{
    BY_BUYER, CANCEL, CONFIRM, Caller, EXTEND, LOOKUP, RESERVE, failed, name_buyer, retry_later,
    served,
};
use crate::answer::{Answer, rfc3339};
use crate::app::App;
use crate::input::{self, Reserve};
use crate::reservation::{Outcome, Settle, VariantRefusal, View};
use crate::service::{self, Path, Served};

pub async fn reserve(
    drop: String,
    caller: Caller,
    app: Arc<App>,
    body: Result<Bytes, Answer>,
) -> Response {
    served(&app, &RESERVE, Some(&drop), caller, async {
        match body {
            Ok(body) => admit(&app, &drop, &body).await,
            Err(refusal) => refusal,
        }
    })
    .await
}

pub async fn confirm(
    drop: String,
    key: String,
    caller: Caller,
    app: Arc<App>,
    body: Result<Bytes, Answer>,
) -> Response {
    let answer = settle_with_body(&app, &drop, &key, Settle::Confirm { quantity: None }, body);
    served(&app, &CONFIRM, Some(&drop), caller, answer).await
}

pub async fn cancel(
    drop: String,
    key: String,
    caller: Caller,
    app: Arc<App>,
    body: Result<Bytes, Answer>,
) -> Response {
    let answer = settle_with_body(&app, &drop, &key, Settle::Cancel, body);
    served(&app, &CANCEL, Some(&drop), caller, answer).await
}

/// A confirm or cancel with its optional body (`{"user"}`, and a confirm's
/// `{"quantity"}`), or the body's refusal.
async fn settle_with_body(
    app: &App,
    drop: &str,
    key: &str,
    settle_as: Settle,
    body: Result<Bytes, Answer>,
) -> Answer {
    match body {
        Ok(body) => settle(app, drop, key, settle_as, &body).await,
        Err(refusal) => refusal,
    }
}

/// `POST .../reservations/{key}/extend` with `{"expiresAt"}` (and optionally
/// `{"user"}`): moves an active hold's deadline.
pub async fn extend(
    drop: String,
    key: String,
    caller: Caller,
    app: Arc<App>,
    body: Result<Bytes, Answer>,
) -> Response {
    let answer = async {
        let body = match body {
            Ok(body) => body,
            Err(refusal) => return refusal,
        };
        let parsed = input::path_id("key", &key).and_then(|key| {
            Ok((
                input::path_id("drop", &drop)?,
                key,
                input::ExtendTo::parse(&body)?,
            ))
        });
        let (drop, key, asked) = match parsed {
            Ok(parsed) => parsed,
            Err(invalid) => return Answer::invalid(invalid.0),
        };
        name_buyer(&app, &key, None);
        let settle = Settle::Extend {
            until_ms: asked.until_ms,
        };
        let asked_about = Asked {
            app: &app,
            drop: &drop,
            key: &key,
            user: None,
            quantity: 0,
            variant: None,
        };
        match service::settle_for(&app, &drop, &key, settle, asked.user.as_deref()).await {
            Ok(served) => asked_about.answer(served),
            Err(failure) => failed(&app, failure),
        }
    };
    served(&app, &EXTEND, Some(&drop), caller, answer).await
}

pub async fn lookup(drop: String, key: String, caller: Caller, app: Arc<App>) -> Response {
    let answer = settle(&app, &drop, &key, Settle::Lookup, b"");
    served(&app, &LOOKUP, Some(&drop), caller, answer).await
}

/// `GET /v1/drops/{drop}/reservations?user=U`: the buyer's reservations.
pub async fn by_buyer(drop: String, query: String, caller: Caller, app: Arc<App>) -> Response {
    let answer = async {
        let parsed =
            input::buyer_query(&query).and_then(|user| Ok((input::path_id("drop", &drop)?, user)));
        let (drop, user) = match parsed {
            Ok(parsed) => parsed,
            Err(invalid) => return Answer::invalid(invalid.0),
        };
        match service::reservations_of(&app, &drop, &user).await {
            Ok(bought) => {
                let listed: Vec<serde_json::Value> = bought
                    .reservations
                    .iter()
                    .map(|(key, view)| {
                        let reservation = &view.reservation;
                        serde_json::json!({
                            "key": key,
                            "variant": reservation.variant,
                            "quantity": reservation.quantity,
                            "state": reservation.state.as_str(),
                            "expiresAt": rfc3339(reservation.expires_at_ms),
                        })
                    })
                    .collect();
                mark(
                    Answer::new(StatusCode::OK, "found")
                        .with("drop", drop.as_str())
                        .with("user", user.as_str())
                        .with("reservations", serde_json::Value::Array(listed)),
                    bought.path,
                )
            }
            Err(failure) => failed(&app, failure),
        }
    };
    served(&app, &BY_BUYER, Some(&drop), caller, answer).await
}

async fn admit(app: &App, raw_drop: &str, body: &[u8]) -> Answer {
    let parsed =
        Reserve::parse(body).and_then(|request| Ok((input::path_id("drop", raw_drop)?, request)));
    let (drop, request) = match parsed {
        Ok(parsed) => parsed,
        Err(invalid) => return Answer::invalid(invalid.0),
    };
    name_buyer(app, &request.key, Some(&request.user));
    let asked = Asked {
        app,
        drop: &drop,
        key: &request.key,
        user: Some(&request.user),
        quantity: request.quantity,
        variant: request.variant.as_deref(),
    };
    match service::reserve(app, &drop, &request).await {
        Ok(served) => asked.answer(served),
        Err(failure) => failed(app, failure),
    }
}

async fn settle(app: &App, raw_drop: &str, raw_key: &str, settle: Settle, body: &[u8]) -> Answer {
    let parsed = input::path_id("key", raw_key).and_then(|key| {
        let body = match settle {
            Settle::Confirm { .. } => input::SettleAs::parse_confirm(body)?,
            Settle::Cancel | Settle::CancelHold | Settle::Lookup | Settle::Extend { .. } => {
                input::SettleAs::parse(body)?
            }
        };
        Ok((input::path_id("drop", raw_drop)?, key, body))
    });
    let (drop, key, on_behalf) = match parsed {
        Ok(parsed) => parsed,
        Err(invalid) => return Answer::invalid(invalid.0),
    };
    let settle = match settle {
        Settle::Confirm { .. } => Settle::Confirm {
            quantity: on_behalf.quantity,
        },
        other => other,
    };
    name_buyer(app, &key, None);
    let asked = Asked {
        app,
        drop: &drop,
        key: &key,
        user: None,
        quantity: on_behalf.quantity.unwrap_or(0),
        variant: None,
    };
    match service::settle_for(app, &drop, &key, settle, on_behalf.user.as_deref()).await {
        Ok(served) => asked.answer(served),
        Err(failure) => failed(app, failure),
    }
}

/// What the call asked about: what its answer names.
struct Asked<'a> {
    app: &'a App,
    drop: &'a str,
    key: &'a str,
    /// The buyer, quantity and variant of a reserve.
    user: Option<&'a str>,
    quantity: i64,
    variant: Option<&'a str>,
}

impl Asked<'_> {
    /// The answer for what the service decided.
    fn answer(&self, served: Served) -> Answer {
        let Served { outcome, path } = served;
        let (drop, key) = (self.drop, self.key);
        let answer = match outcome {
            Outcome::Admitted(view) => self.reservation(StatusCode::CREATED, "admitted", &view, path),
            Outcome::AlreadyReserved(view) => {
                self.reservation(StatusCode::OK, "already_reserved", &view, path)
            }
            Outcome::Found(view) => self.reservation(StatusCode::OK, "found", &view, path),
            Outcome::Confirmed(view) => self.reservation(StatusCode::OK, "confirmed", &view, path),
            Outcome::AlreadyConfirmed(view) => {
                self.reservation(StatusCode::OK, "already_confirmed", &view, path)
            }
            Outcome::Cancelled(view) => self.reservation(StatusCode::OK, "cancelled", &view, path),
            Outcome::AlreadyCancelled(view) => {
                self.reservation(StatusCode::OK, "already_cancelled", &view, path)
            }
            Outcome::SoldOut { remaining } => match self.variant {
                // A size sold out: the answer names it, and what it has left.
                Some(variant) => Answer::refusal(
                    StatusCode::CONFLICT,
                    "sold_out",
                    format!(
                        "variant {variant} of drop {drop} is sold out: {} left, {} asked for",
                        remaining.max(0),
                        self.quantity
                    ),
                )
                .with("variant", variant),
                None => Answer::refusal(
                    StatusCode::CONFLICT,
                    "sold_out",
                    format!(
                        "drop {drop} is sold out: {} left, {} asked for",
                        remaining.max(0),
                        self.quantity
                    ),
                ),
            }
            .with("remaining", remaining.max(0)),
            Outcome::PerUserLimit { held, limit } => Answer::refusal(
                StatusCode::CONFLICT,
                "per_user_limit_exceeded",
                format!(
                    "user {} already holds {held} of the {limit} units one user may hold in drop {drop}",
                    self.user.unwrap_or_default()
                ),
            ),
            Outcome::KeyReused => Answer::refusal(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                format!("key {key} was already used in drop {drop} for a different user, quantity or variant"),
            ),
            Outcome::NotOpen { starts_at_ms } => Answer::refusal(
                StatusCode::FORBIDDEN,
                "not_open",
                format!("drop {drop} is not open yet"),
            )
            .with("startsAt", starts_at_ms.map_or(serde_json::Value::Null, rfc3339)),
            Outcome::Ended { ends_at_ms } => Answer::refusal(
                StatusCode::FORBIDDEN,
                "ended",
                format!("drop {drop} has ended"),
            )
            .with("endsAt", ends_at_ms.map_or(serde_json::Value::Null, rfc3339)),
            Outcome::Paused => Answer::refusal(
                StatusCode::FORBIDDEN,
                "paused",
                format!("drop {drop} is paused by the shop: no new reservations for now, retry later"),
            ),
            Outcome::CartLine {
                cart,
                asked: Settle::Extend { .. },
            } => Answer::refusal(
                StatusCode::CONFLICT,
                "extension_refused",
                format!(
                    "reservation {key} is a line of cart {cart}: it is held as long as its cart and cannot be extended alone; nothing was changed"
                ),
            ),
            Outcome::CartLine { cart, .. } => Answer::invalid(format!(
                "reservation {key} is a line of cart {cart}: it is confirmed whole, with its cart (POST /v1/carts/{cart}/confirm), never in part; nothing was changed"
            )),
            Outcome::AboveHeld { held } => Answer::invalid(format!(
                "`quantity` {} is more than the {held} units reservation {key} of drop {drop} holds: nothing was changed",
                self.quantity
            )),
            Outcome::Expired(view) => self
                .reservation(StatusCode::CONFLICT, "expired", &view, path)
                .with(
                    "message",
                    format!("reservation {key} expired and its units went back to stock"),
                ),
            Outcome::WasCancelled(view) => self
                .reservation(StatusCode::CONFLICT, "cancelled", &view, path)
                .with(
                    "message",
                    format!("reservation {key} was cancelled and cannot be confirmed or extended"),
                ),
            Outcome::WasConfirmed(view) => self
                .reservation(StatusCode::CONFLICT, "confirmed", &view, path)
                .with(
                    "message",
                    format!("reservation {key} is confirmed: no hold is left to extend"),
                ),
            Outcome::Extended(view) => self.reservation(StatusCode::OK, "extended", &view, path),
            Outcome::ExtensionRefused(view) => self
                .reservation(StatusCode::CONFLICT, "extension_refused", &view, path)
                .with(
                    "message",
                    format!(
                        "reservation {key} cannot be held that long: drop {drop}'s maxHoldSeconds, counted from the admission, ends before it; nothing was changed"
                    ),
                ),
            // docs/design.md has no word for it: `expired` (409), the message says which.
            Outcome::RecordExpired(view) => self
                .reservation(StatusCode::CONFLICT, "expired", &view, path)
                .with(
                    "message",
                    format!(
                        "the gate's record of reservation {key} has expired (the ledger keeps it {}): it can no longer change",
                        view.reservation.state.as_str()
                    ),
                ),
            Outcome::Overruled { recorded, asked } => Answer::refusal(
                StatusCode::CONFLICT,
                recorded.as_str(),
                format!(
                    "reservation {key} is {} in the ledger: it cannot be {}",
                    recorded.as_str(),
                    match asked {
                        crate::reservation::State::Active => "extended",
                        other => other.as_str(),
                    }
                ),
            ),
            Outcome::Recording => retry_later(format!(
                "reservation {key} is still being recorded: nothing was changed; retry"
            )),
            Outcome::NotFound => Answer::refusal(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no reservation with key {key} in drop {drop}"),
            ),
            Outcome::NotOwner => Answer::refusal(
                StatusCode::CONFLICT,
                "not_owner",
                format!(
                    "reservation {key} of drop {drop} is another buyer's than the `user` named: nothing was changed"
                ),
            ),
            Outcome::UnknownDrop => super::unknown_drop(self.app, drop),
            Outcome::VariantRefused(VariantRefusal::Missing) => Answer::invalid(format!(
                "missing field `variant`: drop {drop} is sold in variants (GET /v1/drops/{drop} lists them)"
            )),
            Outcome::VariantRefused(VariantRefusal::Unexpected(_)) => Answer::invalid(format!(
                "`variant` is given, but drop {drop} has no variants: leave it out"
            )),
            Outcome::VariantRefused(VariantRefusal::Unknown(variant)) => Answer::refusal(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("drop {drop} has no variant {variant}: nothing was reserved"),
            )
            .with("variant", variant),
            // The service acts on these itself; one reaching here is its bug.
            unacted @ (Outcome::Closed
            | Outcome::OffGate(_)
            | Outcome::Pending
            | Outcome::Overdue
            | Outcome::NotHead
            | Outcome::Unsettled(_)
            | Outcome::Listed(_)
            | Outcome::ForeignLedger { .. }) => {
                Answer::unavailable(format!("the gate answered {unacted:?}, which was not acted on"))
            }
        };
        mark(answer, path)
    }

    /// An answer that shows the reservation.
    fn reservation(&self, status: StatusCode, outcome: &str, view: &View, path: Path) -> Answer {
        let reservation = &view.reservation;
        let answer = Answer::new(status, outcome)
            .with("drop", self.drop)
            .with("key", self.key)
            .with("user", reservation.user.as_str())
            .with("quantity", reservation.quantity)
            .with("state", reservation.state.as_str())
            .with("expiresAt", rfc3339(reservation.expires_at_ms))
            // Never below 0, even while a cut is being paid back.
            .with("remaining", view.remaining.max(0))
            .with(
                "path",
                match path {
                    Path::Gate => "gate",
                    Path::Fallback => "fallback",
                },
            );
        // A drop with variants: every answer names the reservation's.
        match &reservation.variant {
            Some(variant) => answer.with("variant", variant.as_str()),
            None => answer,
        }
    }
}

/// Answers of the fallback gate carry `Dropgate-Path: fallback`.
pub(super) fn mark(answer: Answer, path: Path) -> Answer {
    match path {
        Path::Gate => answer,
        Path::Fallback => answer.via_fallback(),
    }
}
