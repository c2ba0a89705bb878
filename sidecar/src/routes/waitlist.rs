//! `POST /v1/drops/{drop}/waitlist`, `GET .../waitlist/{key}` and
//! `POST .../waitlist/{key}/cancel`: input parsed here, decided by the
//! [waitlist service](crate::service::waitlist), answered here.

use std::sync::Arc;

use bytes::Bytes;
use warp::http::StatusCode;
use warp::reply::Response;

use super::{Caller, WAITLIST_JOIN, WAITLIST_LEAVE, WAITLIST_LOOKUP, failed, name_buyer, served};
use crate::answer::{Answer, rfc3339};
use crate::app::App;
use crate::input::{self, Reserve};
use crate::reservation::{VariantRefusal, View};
use crate::service::waitlist::{self, Place, Waiting};

pub async fn join(
    drop: String,
    caller: Caller,
    app: Arc<App>,
    body: Result<Bytes, Answer>,
) -> Response {
    let answer = async {
        let body = match body {
            Ok(body) => body,
            Err(refusal) => return refusal,
        };
        let parsed =
            input::path_id("drop", &drop).and_then(|drop| Ok((drop, Reserve::parse(&body)?)));
        let (drop, request) = match parsed {
            Ok(parsed) => parsed,
            Err(invalid) => return Answer::invalid(invalid.0),
        };
        name_buyer(&app, &request.key, Some(&request.user));
        match waitlist::join(&app, &drop, &request).await {
            Ok(waiting) => Told {
                drop: &drop,
                key: &request.key,
                call: Asked::Join,
            }
            .answer(waiting),
            Err(failure) => failed(&app, failure),
        }
    };
    served(&app, &WAITLIST_JOIN, Some(&drop), caller, answer).await
}

pub async fn lookup(drop: String, key: String, caller: Caller, app: Arc<App>) -> Response {
    let answer = async {
        let (drop, key) = match ids(&drop, &key) {
            Ok(ids) => ids,
            Err(refusal) => return refusal,
        };
        match waitlist::look(&app, &drop, &key).await {
            Ok(waiting) => Told {
                drop: &drop,
                key: &key,
                call: Asked::Look,
            }
            .answer(waiting),
            Err(failure) => failed(&app, failure),
        }
    };
    served(&app, &WAITLIST_LOOKUP, Some(&drop), caller, answer).await
}

pub async fn leave(drop: String, key: String, caller: Caller, app: Arc<App>) -> Response {
    let answer = async {
        let (drop, key) = match ids(&drop, &key) {
            Ok(ids) => ids,
            Err(refusal) => return refusal,
        };
        match waitlist::leave(&app, &drop, &key).await {
            Ok(waiting) => Told {
                drop: &drop,
                key: &key,
                call: Asked::Leave,
            }
            .answer(waiting),
            Err(failure) => failed(&app, failure),
        }
    };
    served(&app, &WAITLIST_LEAVE, Some(&drop), caller, answer).await
}

fn ids(drop: &str, key: &str) -> Result<(String, String), Answer> {
    input::path_id("drop", drop)
        .and_then(|drop| Ok((drop, input::path_id("key", key)?)))
        .map_err(|invalid| Answer::invalid(invalid.0))
}

/// Which call is answered.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Asked {
    Join,
    Look,
    Leave,
}

/// What one call is told: about this entry of this drop.
struct Told<'a> {
    drop: &'a str,
    key: &'a str,
    call: Asked,
}

impl Told<'_> {
    fn answer(&self, waiting: Waiting) -> Answer {
        let (drop, key) = (self.drop, self.key);
        match waiting {
            Waiting::Joined(place) => self.place(StatusCode::CREATED, "waiting", &place),
            Waiting::AlreadyWaiting(place) => {
                // A retried join hears that it was there; a look-up where it stands.
                let outcome = if self.call == Asked::Join {
                    "already_waiting"
                } else {
                    "waiting"
                };
                self.place(StatusCode::OK, outcome, &place)
            }
            // An entry already served cannot leave.
            Waiting::Offered(view) if self.call == Asked::Leave => self
                .offered(StatusCode::CONFLICT, &view)
                .with(
                    "message",
                    format!("entry {key} was served: its hold is reservation {key} (cancel it to give the units back)"),
                ),
            Waiting::Offered(view) => self.offered(StatusCode::OK, &view),
            Waiting::Left => Answer::new(StatusCode::OK, "left")
                .with("drop", drop)
                .with("key", key),
            Waiting::Full { limit } => Answer::refusal(
                StatusCode::CONFLICT,
                "waitlist_full",
                format!("drop {drop}'s waitlist holds its {limit} entries: nothing was changed"),
            ),
            Waiting::PerUserLimit { held, limit } => Answer::refusal(
                StatusCode::CONFLICT,
                "per_user_limit_exceeded",
                format!(
                    "this buyer holds or waits for {held} of the {limit} units one user may have in drop {drop}: nothing was changed"
                ),
            ),
            Waiting::KeyReused => Answer::refusal(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                format!(
                    "key {key} was already used in drop {drop} for a reservation or another place in line: nothing was changed"
                ),
            ),
            Waiting::NotFound => Answer::refusal(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("drop {drop}'s waitlist has no entry {key}"),
            ),
            Waiting::Disabled => Answer::refusal(
                StatusCode::CONFLICT,
                "waitlist_disabled",
                format!("drop {drop} has no waitlist (spec.waitlist.enabled): nothing was changed"),
            ),
            Waiting::NotOpen { starts_at_ms } => Answer::refusal(
                StatusCode::FORBIDDEN,
                "not_open",
                format!("drop {drop} is not open yet"),
            )
            .with("startsAt", starts_at_ms.map_or(serde_json::Value::Null, rfc3339)),
            Waiting::Ended { ends_at_ms } => Answer::refusal(
                StatusCode::FORBIDDEN,
                "ended",
                format!("drop {drop} has ended"),
            )
            .with("endsAt", ends_at_ms.map_or(serde_json::Value::Null, rfc3339)),
            Waiting::VariantRefused(VariantRefusal::Missing) => Answer::invalid(format!(
                "missing field `variant`: drop {drop} is sold in variants, each with a line of its own"
            )),
            Waiting::VariantRefused(VariantRefusal::Unexpected(_)) => Answer::invalid(format!(
                "`variant` is given, but drop {drop} has no variants: leave it out"
            )),
            Waiting::VariantRefused(VariantRefusal::Unknown(variant)) => Answer::refusal(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("drop {drop} has no variant {variant}: nothing was changed"),
            )
            .with("variant", variant),
        }
    }

    /// An entry in line, with its place (1 first).
    fn place(&self, status: StatusCode, outcome: &str, place: &Place) -> Answer {
        let answer = Answer::new(status, outcome)
            .with("drop", self.drop)
            .with("key", self.key)
            .with("user", place.user.as_str())
            .with("quantity", place.quantity)
            .with("position", place.place);
        match &place.variant {
            Some(variant) => answer.with("variant", variant.as_str()),
            None => answer,
        }
    }

    /// A served entry: the reservation its key holds.
    fn offered(&self, status: StatusCode, view: &View) -> Answer {
        let reservation = &view.reservation;
        let answer = Answer::new(status, "offered")
            .with("drop", self.drop)
            .with("key", self.key)
            .with("user", reservation.user.as_str())
            .with("quantity", reservation.quantity)
            .with("state", reservation.state.as_str())
            .with("expiresAt", rfc3339(reservation.expires_at_ms));
        match &reservation.variant {
            Some(variant) => answer.with("variant", variant.as_str()),
            None => answer,
        }
    }
}
