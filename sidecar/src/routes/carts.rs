//! `POST /v1/carts` and the cart's confirm, cancel and look-up: input parsed here,
//! decided by the [cart service](crate::service::cart), answered here.

use std::sync::Arc;

use bytes::Bytes;
use serde_json::{Value, json};
use warp::http::StatusCode;
use warp::reply::Response;

use super::{
    CART_CANCEL, CART_CONFIRM, CART_LOOKUP, CART_RESERVE, Caller, failed, name_buyer, served,
};
use crate::answer::{Answer, rfc3339};
use crate::app::App;
use crate::input::{self, CartLine, CartReserve};
use crate::ledger::carts::CartState;
use crate::reservation::VariantRefusal;
use crate::service::cart::{self, CartOutcome, CartSettle, CartView, ShortLine, ShortWhy};

pub async fn reserve(caller: Caller, app: Arc<App>, body: Result<Bytes, Answer>) -> Response {
    served(&app, &CART_RESERVE, None, caller, async {
        match body.map(|body| CartReserve::parse(&body)) {
            Ok(Ok(request)) => {
                name_buyer(&app, &request.key, Some(&request.user));
                match cart::reserve(&app, &request).await {
                    Ok(outcome) => answer(&request.key, outcome),
                    Err(failure) => failed(&app, failure),
                }
            }
            Ok(Err(invalid)) => Answer::invalid(invalid.0),
            Err(refusal) => refusal,
        }
    })
    .await
}

pub async fn confirm(key: String, caller: Caller, app: Arc<App>) -> Response {
    let answer = settle(&app, &key, CartSettle::Confirm);
    served(&app, &CART_CONFIRM, None, caller, answer).await
}

pub async fn cancel(key: String, caller: Caller, app: Arc<App>) -> Response {
    let answer = settle(&app, &key, CartSettle::Cancel);
    served(&app, &CART_CANCEL, None, caller, answer).await
}

pub async fn lookup(key: String, caller: Caller, app: Arc<App>) -> Response {
    let answer = settle(&app, &key, CartSettle::Lookup);
    served(&app, &CART_LOOKUP, None, caller, answer).await
}

async fn settle(app: &App, raw_key: &str, asked: CartSettle) -> Answer {
    let key = match input::path_id("key", raw_key) {
        Ok(key) => key,
        Err(invalid) => return Answer::invalid(invalid.0),
    };
    name_buyer(app, &key, None);
    match cart::settle(app, &key, asked).await {
        Ok(outcome) => answer(&key, outcome),
        Err(failure) => failed(app, failure),
    }
}

/// Whether an unheld cart's lines may still hold units (being given back by
/// another attempt, or left to the sweeper; a look-up that failed says nothing),
/// in words.
fn held_words(view: &CartView) -> &'static str {
    let still_held = view.held.iter().any(|line| {
        line.reservation
            .as_ref()
            .is_some_and(|r| r.state.holds_units())
    });
    if still_held || view.giving_back {
        "its lines are being given back"
    } else {
        "nothing of it is held"
    }
}

/// The word a cart's state is answered with.
fn state_word(state: CartState) -> &'static str {
    match state {
        CartState::Holding => "pending",
        CartState::Held | CartState::Confirming => "active",
        CartState::Confirmed => "confirmed",
        // A line lapsed before the cart's confirm reached it: its lines say which
        // are confirmed.
        CartState::PartlyConfirmed => "partly_confirmed",
        CartState::Releasing | CartState::Released | CartState::Cancelled => "cancelled",
        CartState::Refused => "refused",
        CartState::Expired => "expired",
    }
}

fn answer(key: &str, outcome: CartOutcome) -> Answer {
    match outcome {
        CartOutcome::Reserved(view) => shown(StatusCode::CREATED, "reserved", &view),
        CartOutcome::AlreadyReserved(view) => shown(StatusCode::OK, "already_reserved", &view),
        CartOutcome::Found(view) => shown(StatusCode::OK, "found", &view),
        CartOutcome::Confirmed(view) => shown(StatusCode::OK, "confirmed", &view),
        CartOutcome::AlreadyConfirmed(view) => shown(StatusCode::OK, "already_confirmed", &view),
        CartOutcome::Cancelled(view) => shown(StatusCode::OK, "cancelled", &view),
        CartOutcome::AlreadyCancelled(view) => shown(StatusCode::OK, "already_cancelled", &view),
        CartOutcome::Short(view) => shown(StatusCode::CONFLICT, "short", &view).with(
            "message",
            format!(
                "cart {key} cannot be held as asked ({} of its lines short): {}",
                view.short.len(),
                held_words(&view)
            ),
        ),
        // Its hold never answered (the attempt that held it stopped): the cart's
        // reserve, retried with its key, finishes or gives it back.
        CartOutcome::Gone(view) if view.state == CartState::Holding => {
            shown(StatusCode::CONFLICT, state_word(view.state), &view).with(
                "message",
                format!(
                    "cart {key} was left unfinished by the attempt that held it: it cannot be confirmed yet; retry the cart's reserve with its key to finish it or give it back"
                ),
            )
        }
        CartOutcome::Gone(view) => {
            let word = state_word(view.state);
            shown(StatusCode::CONFLICT, word, &view).with(
                "message",
                format!(
                    "cart {key} is {word} ({}): it can no longer be confirmed; a new try needs a new key",
                    held_words(&view)
                ),
            )
        }
        CartOutcome::PartlyConfirmed(view) => shown(StatusCode::CONFLICT, "expired", &view).with(
            "message",
            format!(
                "a line of cart {key} expired, was cancelled or its drop deleted before it was confirmed: the cart is not confirmed whole; any line confirmed stays so, the rest are given back, and each line says where it stands"
            ),
        ),
        CartOutcome::KeyReused => Answer::refusal(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_key_reused",
            format!("cart key {key} was already used for another user or other lines"),
        ),
        CartOutcome::LineKeyTaken { key: line } => Answer::refusal(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_key_reused",
            format!(
                "the key {line} of a line of cart {key} is used by a reservation that is not this cart's: nothing is held"
            ),
        ),
        CartOutcome::LineRefused { line, refusal } => line_refused(&line, refusal),
        CartOutcome::NotFound => Answer::refusal(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no cart with key {key}"),
        ),
    }
}

fn line_refused(line: &CartLine, refusal: VariantRefusal) -> Answer {
    let drop = &line.drop;
    match refusal {
        VariantRefusal::Missing => Answer::invalid(format!(
            "a line of drop {drop} has no `variant`: drop {drop} is sold in variants (GET /v1/drops/{drop} lists them)"
        )),
        VariantRefusal::Unexpected(_) => Answer::invalid(format!(
            "a line of drop {drop} gives a `variant`, but drop {drop} has no variants: leave it out"
        )),
        VariantRefusal::Unknown(variant) => Answer::refusal(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("drop {drop} has no variant {variant}: nothing is held"),
        )
        .with("drop", drop.as_str())
        .with("variant", variant),
    }
}

/// An answer that shows the cart.
fn shown(status: StatusCode, outcome: &str, view: &CartView) -> Answer {
    let lines: Vec<Value> = view
        .held
        .iter()
        .map(|held| {
            let mut line = line_json(&held.line);
            line["key"] = held.key.clone().into();
            if let Some(reservation) = &held.reservation {
                line["state"] = reservation.state.as_str().into();
                line["expiresAt"] = rfc3339(reservation.expires_at_ms);
            }
            line
        })
        .collect();
    let short: Vec<Value> = view
        .short
        .iter()
        .filter_map(|short| short_json(&view.lines, short))
        .collect();
    Answer::new(status, outcome)
        .with("key", view.key.as_str())
        .with("user", view.user.as_str())
        .with("state", state_word(view.state))
        .with("expiresAt", view.expires_at_ms.map_or(Value::Null, rfc3339))
        .with("lines", lines)
        .with("short", short)
}

fn line_json(line: &CartLine) -> Value {
    let mut json = json!({"drop": line.drop, "quantity": line.quantity});
    if let Some(variant) = &line.variant {
        json["variant"] = variant.as_str().into();
    }
    json
}

/// A line not held: what it asked, its outcome and why, as a single reserve of it
/// would have said.
fn short_json(lines: &[CartLine], short: &ShortLine) -> Option<Value> {
    let line = lines.get(short.n.checked_sub(1)?)?;
    let mut json = line_json(line);
    let drop = &line.drop;
    let what = match &line.variant {
        Some(variant) => format!("variant {variant} of drop {drop}"),
        None => format!("drop {drop}"),
    };
    let (outcome, message) = match &short.why {
        ShortWhy::SoldOut { remaining } => {
            json["remaining"] = (*remaining).max(0).into();
            (
                "sold_out",
                format!(
                    "{what} is sold out: {} left, {} asked for",
                    remaining.max(&0),
                    line.quantity
                ),
            )
        }
        ShortWhy::PerUserLimitExceeded { held, limit } => (
            "per_user_limit_exceeded",
            format!(
                "the buyer already holds {held} of the {limit} units one user may hold in drop {drop}"
            ),
        ),
        ShortWhy::NotOpen { starts_at_ms } => {
            json["startsAt"] = starts_at_ms.map_or(Value::Null, rfc3339);
            ("not_open", format!("drop {drop} is not open yet"))
        }
        ShortWhy::Ended { ends_at_ms } => {
            json["endsAt"] = ends_at_ms.map_or(Value::Null, rfc3339);
            ("ended", format!("drop {drop} has ended"))
        }
        ShortWhy::Paused => (
            "paused",
            format!("drop {drop} is paused by the shop: no new reservations for now"),
        ),
    };
    json["outcome"] = outcome.into();
    json["message"] = message.into();
    Some(json)
}
