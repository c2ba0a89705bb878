use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// A pooled HTTP/1 client for talking to the sidecar in tests and load runs.
#[derive(Clone)]
pub struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    /// Whether every answer is checked against the OpenAPI document.
    checked: bool,
}

/// One answer: status, headers and the body parsed as JSON (`Null` when it is not).
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: serde_json::Value,
    pub text: String,
}

impl Reply {
    /// The `outcome` word of a dropgate answer.
    pub fn outcome(&self) -> &str {
        self.body["outcome"].as_str().unwrap_or("")
    }

    /// Asserts the answer's status and `outcome` together; a failure prints the
    /// whole answer. `#[track_caller]` makes the panic name the test's line.
    #[track_caller]
    pub fn assert_answer(&self, status: u16, outcome: &str) {
        self.assert_answer_because(status, outcome, "");
    }

    /// [`Reply::assert_answer`] with a word on the case (which path, which
    /// request) ahead of the answer in the failure message.
    #[track_caller]
    pub fn assert_answer_because(&self, status: u16, outcome: &str, context: &str) {
        assert_eq!(
            (self.status.as_u16(), self.outcome()),
            (status, outcome),
            "{context}{}answer: {}",
            if context.is_empty() { "" } else { ": " },
            self.text
        );
    }
}

impl HttpClient {
    /// `base` is `http://127.0.0.1:PORT`. Every answer from a route of the sidecar's
    /// OpenAPI document is checked against it: one that breaks it panics (see
    /// [`crate::openapi`]).
    pub fn new(base: impl Into<String>) -> Self {
        Self {
            checked: true,
            ..Self::unchecked(base)
        }
    }

    /// A client that opens a connection for each request and closes it after, as
    /// the kubelet's HTTP probes do (they disable keep-alive): a full probe port may
    /// close an idle kept-alive connection, which a pooling client would then send
    /// its next probe into.
    pub fn without_keep_alive(base: impl Into<String>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(connector);
        Self {
            client,
            base: base.into(),
            checked: true,
        }
    }

    /// A client that does not check answers against the document: for load runs,
    /// whose measure would include the check.
    pub fn unchecked(base: impl Into<String>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        // The sidecar closes a kept-alive connection idle for its head timeout (10 s);
        // a client that keeps one longer could send a request into that close. As
        // real clients do, let go of an idle connection well before the server does.
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .pool_idle_timeout(std::time::Duration::from_secs(4))
            .build(connector);
        Self {
            client,
            base: base.into(),
            checked: false,
        }
    }

    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<&str>,
    ) -> Result<Reply, Box<dyn std::error::Error + Send + Sync>> {
        self.request_with_headers(method, path, body, &[]).await
    }

    /// [`HttpClient::request`] with more request headers (`traceparent`, say).
    pub async fn request_with_headers(
        &self,
        method: Method,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> Result<Reply, Box<dyn std::error::Error + Send + Sync>> {
        let request_method = method.clone();
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("{}{}", self.base, path));
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        if body.is_some() {
            builder = builder.header("content-type", "application/json");
        }
        let request = builder.body(Full::new(Bytes::from(body.unwrap_or("").to_string())))?;
        let response = self.client.request(request).await?;
        let (parts, incoming) = response.into_parts();
        let bytes = incoming.collect().await?.to_bytes();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        if self.checked
            && let Err(broken) = crate::openapi::contract().check(
                &request_method,
                path,
                parts.status,
                &parts.headers,
                &text,
            )
        {
            panic!("an answer breaks sidecar/openapi.yaml: {broken}");
        }
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body: serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
            text,
        })
    }

    pub async fn get(&self, path: &str) -> Result<Reply, Box<dyn std::error::Error + Send + Sync>> {
        self.request(Method::GET, path, None).await
    }

    pub async fn post(
        &self,
        path: &str,
        body: &str,
    ) -> Result<Reply, Box<dyn std::error::Error + Send + Sync>> {
        self.request(Method::POST, path, Some(body)).await
    }

    pub async fn delete(
        &self,
        path: &str,
        body: &str,
    ) -> Result<Reply, Box<dyn std::error::Error + Send + Sync>> {
        self.request(Method::DELETE, path, Some(body)).await
    }
}
