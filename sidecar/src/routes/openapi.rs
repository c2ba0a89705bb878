//! `GET /openapi.json`: the API's OpenAPI 3.1 document (sidecar/openapi.yaml,
//! compiled in), so a shop can generate a client from the sidecar it runs.

use std::sync::OnceLock;

use warp::http::StatusCode;
use warp::reply::Response;

use crate::answer::Answer;

/// The document as the repository keeps it.
pub const DOCUMENT: &str = include_str!("../../openapi.yaml");

/// The document as JSON, converted once. A document that does not parse is the
/// build's bug: a test parses it (`the_document_parses`).
fn as_json() -> &'static Result<serde_json::Value, String> {
    static JSON: OnceLock<Result<serde_json::Value, String>> = OnceLock::new();
    JSON.get_or_init(|| serde_norway::from_str(DOCUMENT).map_err(|e| e.to_string()))
}

pub async fn serve() -> Response {
    match as_json() {
        Ok(document) => warp::reply::Reply::into_response(warp::reply::with_status(
            warp::reply::json(document),
            StatusCode::OK,
        )),
        Err(e) => {
            Answer::unavailable(format!("the OpenAPI document does not parse: {e}")).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_document_parses() {
        let document = super::as_json().as_ref().expect("openapi.yaml parses");
        assert_eq!(document["openapi"], "3.1.0");
    }
}
