//! The HTTP API: one module per route group, all answering [`Answer`]s.

mod carts;
mod drops;
mod health;
mod locks;
mod openapi;
mod reservations;
mod waitlist;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use tracing::Instrument;
use warp::filters::BoxedFilter;
use warp::http::StatusCode;
use warp::reply::Response;
use warp::{Filter, Rejection};

use crate::answer::Answer;
use crate::app::App;
use crate::service::{Failure, Retry, Throttled, UnderWay};

/// Largest request body accepted: the bodies are a few short fields.
pub const MAX_BODY_BYTES: usize = 16 * 1024;

/// Every route of the API.
pub fn all(app: Arc<App>) -> BoxedFilter<(Response,)> {
    let app_state = app.clone();
    let app = warp::any().map(move || app.clone());
    let body = warp::body::stream().then(read_body);

    let reserve = warp::path!("v1" / "drops" / String / "reservations")
        .and(warp::post())
        .and(caller())
        .and(app.clone())
        .and(body)
        .then(reservations::reserve);
    let confirm = warp::path!("v1" / "drops" / String / "reservations" / String / "confirm")
        .and(warp::post())
        .and(caller())
        .and(app.clone())
        .and(body)
        .then(reservations::confirm);
    let cancel = warp::path!("v1" / "drops" / String / "reservations" / String / "cancel")
        .and(warp::post())
        .and(caller())
        .and(app.clone())
        .and(body)
        .then(reservations::cancel);
    let extend = warp::path!("v1" / "drops" / String / "reservations" / String / "extend")
        .and(warp::post())
        .and(caller())
        .and(app.clone())
        .and(body)
        .then(reservations::extend);
    let by_buyer = warp::path!("v1" / "drops" / String / "reservations")
        .and(warp::get())
        .and(warp::query::raw().or(warp::any().map(String::new)).unify())
        .and(caller())
        .and(app.clone())
        .then(reservations::by_buyer);
    let lookup = warp::path!("v1" / "drops" / String / "reservations" / String)
        .and(warp::get())
        .and(caller())
        .and(app.clone())
        .then(reservations::lookup);
    let waitlist_join = warp::path!("v1" / "drops" / String / "waitlist")
        .and(warp::post())
        .and(caller())
        .and(app.clone())
        .and(body)
        .then(waitlist::join);
    let waitlist_leave = warp::path!("v1" / "drops" / String / "waitlist" / String / "cancel")
        .and(warp::post())
        .and(caller())
        .and(app.clone())
        .then(waitlist::leave);
    let waitlist_lookup = warp::path!("v1" / "drops" / String / "waitlist" / String)
        .and(warp::get())
        .and(caller())
        .and(app.clone())
        .then(waitlist::lookup);
    let cart_reserve = warp::path!("v1" / "carts")
        .and(warp::post())
        .and(caller())
        .and(app.clone())
        .and(body)
        .then(carts::reserve);
    let cart_confirm = warp::path!("v1" / "carts" / String / "confirm")
        .and(warp::post())
        .and(caller())
        .and(app.clone())
        .then(carts::confirm);
    let cart_cancel = warp::path!("v1" / "carts" / String / "cancel")
        .and(warp::post())
        .and(caller())
        .and(app.clone())
        .then(carts::cancel);
    let cart_lookup = warp::path!("v1" / "carts" / String)
        .and(warp::get())
        .and(caller())
        .and(app.clone())
        .then(carts::lookup);
    let drop = warp::path!("v1" / "drops" / String)
        .and(warp::get())
        .and(caller())
        .and(app.clone())
        .then(drops::show);
    let lock_acquire = warp::path!("v1" / "locks" / String)
        .and(warp::post())
        .and(caller())
        .and(app.clone())
        .and(body)
        .then(locks::acquire);
    let lock_renew = warp::path!("v1" / "locks" / String / "renew")
        .and(warp::post())
        .and(caller())
        .and(app.clone())
        .and(body)
        .then(locks::renew);
    let lock_release = warp::path!("v1" / "locks" / String)
        .and(warp::delete())
        .and(caller())
        .and(app.clone())
        .and(body)
        .then(locks::release);
    let document = warp::path!("openapi.json")
        .and(warp::get())
        .then(openapi::serve);
    // `/v1/drops//reservations` or a trailing `/`: an empty segment is a missing
    // name, said as such rather than as a route or method that does not exist.
    let empty_segment = warp::path::full().and_then(|path: warp::path::FullPath| async move {
        let path = path.as_str();
        if path.contains("//") || (path.len() > 1 && path.ends_with('/')) {
            Ok(Answer::invalid(format!(
                "the path {path} has an empty segment: a name is missing"
            ))
            .into_response())
        } else {
            Err(warp::reject::not_found())
        }
    });

    // Each group boxed: a request's poll then runs through a few boxed futures
    // instead of one nested chain of every route (whose frames overflowed a
    // worker's stack in debug builds).
    let reservations = reserve
        .or(confirm)
        .unify()
        .or(cancel)
        .unify()
        .or(extend)
        .unify()
        .or(by_buyer)
        .unify()
        .or(lookup)
        .unify()
        .or(drop)
        .unify()
        .boxed();
    let carts = cart_reserve
        .or(cart_confirm)
        .unify()
        .or(cart_cancel)
        .unify()
        .or(cart_lookup)
        .unify()
        .boxed();
    let waitlist = waitlist_join
        .or(waitlist_leave)
        .unify()
        .or(waitlist_lookup)
        .unify()
        .boxed();
    let locks = lock_acquire
        .or(lock_renew)
        .unify()
        .or(lock_release)
        .unify()
        .boxed();

    empty_segment
        .or(reservations)
        .unify()
        .or(carts)
        .unify()
        .or(waitlist)
        .unify()
        .or(locks)
        .unify()
        .or(document)
        .unify()
        .or(probes(app_state))
        .unify()
        .recover(rejected)
        .unify()
        .boxed()
}

/// The probe and scrape endpoints alone: what `--health-listen` serves outside
/// the pod, without the API.
pub fn health_only(app: Arc<App>) -> BoxedFilter<(Response,)> {
    probes(app).recover(rejected).unify().boxed()
}

/// `/healthz`, `/readyz` and `/metrics`, on the API's listener and the health one.
fn probes(app: Arc<App>) -> BoxedFilter<(Response,)> {
    let app = warp::any().map(move || app.clone());
    // The path before the method, as every route: a POST to a path no route has
    // is then 404, not 405 (warp answers the most specific rejection).
    let healthz = warp::path!("healthz").and(warp::get()).then(health::live);
    let readyz = warp::path!("readyz")
        .and(warp::get())
        .and(app.clone())
        .then(health::ready);
    let metrics = warp::path!("metrics")
        .and(warp::get())
        .and(app)
        .then(health::metrics);
    healthz.or(readyz).unify().or(metrics).unify().boxed()
}

/// The request body, at most [`MAX_BODY_BYTES`]. Read as a stream so that an empty
/// body, a chunked one and an oversized one all get a JSON answer from the handler.
async fn read_body<S, B>(stream: S) -> Result<Bytes, Answer>
where
    S: futures::Stream<Item = Result<B, warp::Error>>,
    B: warp::Buf,
{
    let mut body = Vec::new();
    let mut stream = std::pin::pin!(stream);
    while let Some(chunk) = stream.next().await {
        let mut chunk =
            chunk.map_err(|e| Answer::invalid(format!("the body could not be read: {e}")))?;
        if body.len() + chunk.remaining() > MAX_BODY_BYTES {
            return Err(Answer::refusal(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid",
                format!("the body must be at most {MAX_BODY_BYTES} bytes"),
            ));
        }
        while chunk.has_remaining() {
            let part = chunk.chunk();
            body.extend_from_slice(part);
            let n = part.len();
            chunk.advance(n);
        }
    }
    Ok(Bytes::from(body))
}

/// Seconds a throttled or told-to-retry caller is asked to wait: permits free up
/// as others confirm, hand-overs and records take moments.
const RETRY_AFTER_SECONDS: u64 = 1;

/// The answer when the service could decide nothing.
fn failed(app: &App, failure: Failure) -> Answer {
    match failure {
        Failure::UnknownDrop { name, .. } => unknown_drop(app, &name),
        Failure::Throttled { permits, why, path } => {
            let why = match why {
                Throttled::NoPermit => format!(
                    "all {permits} reservation permits of this sidecar are in use: nothing was reserved"
                ),
                Throttled::KeyInFlight => "an earlier attempt with this key is unresolved; it is activated or taken back, or past its bound resolved from the ledger, within a few seconds".into(),
                Throttled::ExpiredWhileWaiting => {
                    "the admission's hold expired while it waited for a permit: nothing is held".into()
                }
            };
            reservations::mark(
                Answer::refusal(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "throttled",
                    format!("{why}: retry the same key after {RETRY_AFTER_SECONDS}s"),
                )
                .retry_after(RETRY_AFTER_SECONDS),
                path,
            )
        }
        Failure::Unavailable { why, path, retry } => {
            let answer = match retry {
                Retry::SameKey => Answer::unavailable(why),
                Retry::SameKeySoon => retry_later(why),
                // The 503s after which something changed, or may have (a spent key's
                // below too): said in the body, so a client need not read the
                // sentence.
                Retry::SameKeyToLearn => retry_later(why).with("outcomeUnknown", true),
                Retry::SameKeyToGoOn {
                    under_way,
                    outcome_unknown,
                } => {
                    let mut answer = retry_later(why).with("underWay", true);
                    if let UnderWay::Confirm { lines_confirmed } = under_way {
                        answer = answer.with("confirmedLines", lines_confirmed);
                    }
                    if outcome_unknown {
                        answer.with("outcomeUnknown", true)
                    } else {
                        answer
                    }
                }
                // Said in the body too, so a client need not read the sentence.
                Retry::NewKey => Answer::unavailable(why).with("keySpent", true),
            };
            reservations::mark(answer, path)
        }
    }
}

/// 503 with Retry-After: asking again soon will do (the body says if something
/// changed).
fn retry_later(why: String) -> Answer {
    Answer::unavailable(why).retry_after(RETRY_AFTER_SECONDS)
}

/// 404 for a drop this sidecar's namespace does not publish.
fn unknown_drop(app: &App, name: &str) -> Answer {
    Answer::refusal(
        StatusCode::NOT_FOUND,
        "not_found",
        format!(
            "no drop named {name} in namespace {}",
            app.drops.namespace()
        ),
    )
}

/// An API route as its span and its metrics name it.
pub(crate) struct Route {
    /// The `route` label of the metrics.
    label: &'static str,
    method: &'static str,
    /// The path template (`http.route`).
    template: &'static str,
    /// `{method} {template}`, the server span's name.
    span: &'static str,
}

macro_rules! route {
    ($label:literal, $method:literal, $template:literal) => {
        Route {
            label: $label,
            method: $method,
            template: $template,
            span: concat!($method, " ", $template),
        }
    };
}

const RESERVE: Route = route!("reserve", "POST", "/v1/drops/{drop}/reservations");
const CONFIRM: Route = route!(
    "confirm",
    "POST",
    "/v1/drops/{drop}/reservations/{key}/confirm"
);
const CANCEL: Route = route!(
    "cancel",
    "POST",
    "/v1/drops/{drop}/reservations/{key}/cancel"
);
const EXTEND: Route = route!(
    "extend",
    "POST",
    "/v1/drops/{drop}/reservations/{key}/extend"
);
const LOOKUP: Route = route!("lookup", "GET", "/v1/drops/{drop}/reservations/{key}");
const BY_BUYER: Route = route!("by_buyer", "GET", "/v1/drops/{drop}/reservations");
const WAITLIST_JOIN: Route = route!("waitlist_join", "POST", "/v1/drops/{drop}/waitlist");
const WAITLIST_LOOKUP: Route = route!("waitlist_lookup", "GET", "/v1/drops/{drop}/waitlist/{key}");
const WAITLIST_LEAVE: Route = route!(
    "waitlist_leave",
    "POST",
    "/v1/drops/{drop}/waitlist/{key}/cancel"
);
const CART_RESERVE: Route = route!("cart_reserve", "POST", "/v1/carts");
const CART_CONFIRM: Route = route!("cart_confirm", "POST", "/v1/carts/{key}/confirm");
const CART_CANCEL: Route = route!("cart_cancel", "POST", "/v1/carts/{key}/cancel");
const CART_LOOKUP: Route = route!("cart_lookup", "GET", "/v1/carts/{key}");
const SHOW: Route = route!("drop", "GET", "/v1/drops/{drop}");
const LOCK_ACQUIRE: Route = route!("lock_acquire", "POST", "/v1/locks/{name}");
const LOCK_RENEW: Route = route!("lock_renew", "POST", "/v1/locks/{name}/renew");
const LOCK_RELEASE: Route = route!("lock_release", "DELETE", "/v1/locks/{name}");

/// The caller's W3C trace context (`traceparent`, `tracestate`). A header that is
/// not text counts as absent: tracing never refuses a request.
#[derive(Debug, Default)]
pub(crate) struct Caller {
    traceparent: Option<String>,
    tracestate: Option<String>,
}

fn caller() -> impl Filter<Extract = (Caller,), Error = Infallible> + Clone {
    let header = |name: &'static str| {
        warp::header::optional::<String>(name)
            .or(warp::any().map(|| None))
            .unify()
    };
    header("traceparent")
        .and(header("tracestate"))
        .map(|traceparent, tracestate| Caller {
            traceparent,
            tracestate,
        })
}

/// Serves one request of `route` about drop `drop` (the path segment as sent): runs
/// `handler` in the request's server span (a child of the caller's span when the
/// caller sent one), then counts, times and sends its answer. A drop name this
/// sidecar does not serve is neither a metric label nor a span attribute.
async fn served(
    app: &App,
    route: &Route,
    drop: Option<&str>,
    caller: Caller,
    handler: impl Future<Output = Answer>,
) -> Response {
    let started = Instant::now();
    // `request` in logs (a span's name there must be a constant); in a trace,
    // `otel.name`: the method and route, as OpenTelemetry names server spans. No
    // `url.path`: a confirm's path holds the buyer's idempotency key.
    let span = tracing::debug_span!(
        "request",
        otel.name = route.span,
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = route.method,
        http.route = route.template,
        http.response.status_code = tracing::field::Empty,
        dropgate.drop = tracing::field::Empty,
        dropgate.outcome = tracing::field::Empty,
        dropgate.path = tracing::field::Empty,
        dropgate.user = tracing::field::Empty,
        dropgate.key = tracing::field::Empty,
    );
    dropgate_telemetry::continue_trace(
        &span,
        caller.traceparent.as_deref(),
        caller.tracestate.as_deref(),
    );
    let answer = handler.instrument(span.clone()).await;
    // Known only now: the handler loads a drop on its first request.
    let drop = drop.filter(|name| app.drops.knows(name)).unwrap_or("");
    if !drop.is_empty() {
        span.record("dropgate.drop", drop);
    }
    let status = answer.status();
    span.record("http.response.status_code", i64::from(status.as_u16()));
    span.record("dropgate.outcome", answer.outcome());
    span.record("dropgate.path", answer.path());
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    app.metrics.observe(
        route.label,
        drop,
        answer.outcome(),
        answer.path(),
        started.elapsed().as_secs_f64(),
    );
    answer.into_response()
}

/// Names the buyer on the request's span, when `--trace-buyer-ids` asks for it.
fn name_buyer(app: &App, key: &str, user: Option<&str>) {
    if app.trace_buyer_ids {
        let span = tracing::Span::current();
        span.record("dropgate.key", key);
        if let Some(user) = user {
            span.record("dropgate.user", user);
        }
    }
}

/// What warp refused before any handler ran, as JSON answers like the rest.
async fn rejected(rejection: Rejection) -> Result<Response, Infallible> {
    let answer = if rejection.is_not_found() {
        Answer::refusal(StatusCode::NOT_FOUND, "not_found", "no such route")
    } else if rejection.find::<warp::reject::MethodNotAllowed>().is_some() {
        Answer::refusal(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid",
            "this method is not allowed on this route",
        )
    } else {
        Answer::invalid(format!("the request was refused: {rejection:?}"))
    };
    Ok(answer.into_response())
}
