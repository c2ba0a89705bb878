//! The JSON answers of the HTTP API: every one carries `outcome`, refusals a
//! `message` for a person.

use serde_json::{Map, Value};
use warp::http::{HeaderValue, StatusCode};
use warp::reply::Response;

#[derive(Debug, Clone)]
pub struct Answer {
    pub status: StatusCode,
    body: Map<String, Value>,
    /// Seconds for `Retry-After` (a 503 after which asking again soon will do).
    retry_after: Option<u64>,
    /// `Dropgate-Path: fallback` for answers from the SQL ledger's gate.
    fallback: bool,
}

impl Answer {
    pub fn new(status: StatusCode, outcome: &str) -> Self {
        let mut body = Map::new();
        body.insert("outcome".into(), outcome.into());
        Self {
            status,
            body,
            retry_after: None,
            fallback: false,
        }
    }

    /// A refusal: `outcome` plus a sentence saying why.
    pub fn refusal(status: StatusCode, outcome: &str, message: impl Into<String>) -> Self {
        Self::new(status, outcome).with("message", message.into())
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::refusal(StatusCode::BAD_REQUEST, "invalid", message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::refusal(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }

    pub fn with(mut self, field: &str, value: impl Into<Value>) -> Self {
        self.body.insert(field.into(), value.into());
        self
    }

    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    pub fn via_fallback(mut self) -> Self {
        self.fallback = true;
        self
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Which gate answered: `fallback` when the answer carries its header.
    pub fn path(&self) -> &'static str {
        if self.fallback { "fallback" } else { "gate" }
    }

    pub fn outcome(&self) -> &str {
        self.body
            .get("outcome")
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    pub fn into_response(self) -> Response {
        let mut response = warp::reply::Reply::into_response(warp::reply::with_status(
            warp::reply::json(&self.body),
            self.status,
        ));
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert("retry-after", HeaderValue::from(seconds));
        }
        if self.fallback {
            response
                .headers_mut()
                .insert("dropgate-path", HeaderValue::from_static("fallback"));
        }
        response
    }
}

/// Milliseconds since the epoch as RFC 3339 UTC, the API's time format.
pub fn rfc3339(ms: i64) -> Value {
    jiff::Timestamp::from_millisecond(ms)
        .map(|t| Value::String(t.to_string()))
        .unwrap_or(Value::Null)
}
