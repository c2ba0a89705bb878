//! Logs and traces, the same for both binaries.
//!
//! Logs go to stderr (so `crdgen`, `apply` and `inject` print clean YAML on stdout),
//! filtered by `RUST_LOG`, as text for a person or as JSON lines for a log pipeline
//! ([`LogFormat`]: each binary's `--log-format`, or `DROPGATE_LOG_FORMAT`).
//!
//! Traces leave the process only when the standard OpenTelemetry environment names
//! an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`, or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`). Then dropgate's spans go out over OTLP/HTTP
//! in protobuf, batched on the binary's Tokio runtime, and `OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`,
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT` and `OTEL_BSP_*` mean
//! what the specification says. Not spoken: gRPC, compression, a custom CA
//! (`OTEL_EXPORTER_OTLP_CERTIFICATE`; public roots only), propagators other than W3C
//! trace context. With no endpoint there is no exporter, no span processor and no
//! OpenTelemetry layer: the request path's spans are at debug level, so at the
//! default `RUST_LOG` they are disabled where they are written and cost a relaxed
//! load each.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use tracing::{Level, Metadata, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{EnvFilter, FilterFn};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, fmt};

/// Whether spans are being exported: the request path reads the caller's trace
/// context only then.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// How long [`Telemetry::shutdown`] waits for the last spans to leave.
pub const SHUTDOWN_BOUND: Duration = Duration::from_secs(3);

/// How long one export may take when the environment does not say.
const DEFAULT_EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The process's logging and tracing; [`Telemetry::shutdown`] sends the spans still
/// queued.
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// What the environment asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Export {
    /// No endpoint, `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`.
    Off,
    /// OTLP/HTTP protobuf to `endpoint`, each export bounded by `timeout`.
    Otlp {
        /// The traces URL (`.../v1/traces`), as the exporter resolves it.
        endpoint: String,
        timeout: Duration,
    },
    /// Something dropgate cannot do; nothing is exported and the reason is logged.
    Refused(String),
}

impl Export {
    /// Reads the standard variables through `var` (the process environment, or a
    /// table in tests).
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Export {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Export::Off;
        }
        match set("OTEL_TRACES_EXPORTER").as_deref().map(str::trim) {
            None | Some("otlp") => {}
            Some("none") => return Export::Off,
            Some(other) => {
                return Export::Refused(format!(
                    "OTEL_TRACES_EXPORTER={other}: dropgate exports traces over otlp only (or none)"
                ));
            }
        }
        let endpoint = match (
            set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            set("OTEL_EXPORTER_OTLP_ENDPOINT"),
        ) {
            // The signal's own variable is the URL as given; the general one is a
            // base the signal's path is appended to.
            (Some(traces), _) => traces.trim().to_string(),
            (None, Some(base)) => format!("{}/v1/traces", base.trim().trim_end_matches('/')),
            (None, None) => return Export::Off,
        };
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return Export::Refused(format!(
                "the OTLP endpoint {endpoint} is not an http:// or https:// URL"
            ));
        }
        let protocol = set("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .or_else(|| set("OTEL_EXPORTER_OTLP_PROTOCOL"));
        if let Some(protocol) = protocol.filter(|p| p.trim() != "http/protobuf") {
            return Export::Refused(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: dropgate sends http/protobuf only; point the endpoint at the collector's OTLP/HTTP port (usually 4318)"
            ));
        }
        let timeout = match set("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
            .or_else(|| set("OTEL_EXPORTER_OTLP_TIMEOUT"))
        {
            None => DEFAULT_EXPORT_TIMEOUT,
            Some(ms) => match ms.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => Duration::from_millis(ms),
                _ => {
                    return Export::Refused(format!(
                        "OTEL_EXPORTER_OTLP_TIMEOUT={ms}: expected a whole number of milliseconds above 0"
                    ));
                }
            },
        };
        Export::Otlp { endpoint, timeout }
    }
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// One line of text per event, for a person (colours on a terminal).
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `fields`, `target`, `span`,
    /// `spans`), for a log pipeline.
    Json,
}

impl LogFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

impl std::fmt::Display for LogFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("{other:?} is not a log format: text or json")),
        }
    }
}

impl Telemetry {
    /// Installs the process's subscriber: logs to stderr (`RUST_LOG`, else
    /// `default_filter`) in `format`, and, when the environment asks, spans over OTLP
    /// as `service` (unless `OTEL_SERVICE_NAME` or `OTEL_RESOURCE_ATTRIBUTES` names
    /// the service). Call it inside the Tokio runtime: the exporter runs on it.
    pub fn init(service: &'static str, default_filter: &str, format: LogFormat) -> Telemetry {
        // The exporter's own chatter only when it goes wrong (a failed export).
        let filter = EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| EnvFilter::new(format!("{default_filter},opentelemetry=warn")));
        let logs = match format {
            LogFormat::Text => fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .boxed(),
            LogFormat::Json => fmt::layer()
                .json()
                .with_writer(std::io::stderr)
                .with_current_span(true)
                .with_span_list(true)
                .boxed(),
        }
        .with_filter(filter);
        let export = Export::from_env(|name| std::env::var(name).ok());
        let (provider, refused) = match &export {
            Export::Otlp { endpoint, timeout } => match provider(service, endpoint, *timeout) {
                Ok(provider) => (Some(provider), None),
                Err(why) => (None, Some(why)),
            },
            Export::Refused(why) => (None, Some(why.clone())),
            Export::Off => (None, None),
        };
        let traces = provider.as_ref().map(|provider| {
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer(service))
                // Attributes a trace reader wants, not the code's whereabouts.
                .with_threads(false)
                .with_target(false)
                .with_location(false)
                .with_tracked_inactivity(false)
                .with_filter(FilterFn::new(exported))
        });
        tracing_subscriber::registry()
            .with(logs)
            .with(traces)
            .init();
        EXPORTING.store(provider.is_some(), Ordering::Relaxed);
        match (&export, refused) {
            (_, Some(why)) => tracing::error!("traces are not exported: {why}"),
            (Export::Otlp { endpoint, .. }, None) => {
                tracing::info!(%endpoint, "exporting traces over OTLP/HTTP")
            }
            _ => {}
        }
        Telemetry { provider }
    }

    /// Sends the spans still queued and stops the exporter, for at most
    /// [`SHUTDOWN_BOUND`]. Call it before the process exits.
    pub async fn shutdown(self) {
        let Some(provider) = self.provider else {
            return;
        };
        // The batch processor's shutdown blocks until its task on this runtime has
        // sent every queued batch, each bounded only by the export timeout: behind a
        // collector that hangs that is minutes, past a pod's grace period. Waited
        // for off the runtime's workers and only so long; whatever is left goes
        // with the runtime.
        let flushing = tokio::task::spawn_blocking(move || provider.shutdown());
        let unsent = match tokio::time::timeout(SHUTDOWN_BOUND, flushing).await {
            Ok(Ok(Ok(()))) => return,
            Ok(Ok(Err(e))) => e.to_string(),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("the collector did not take them within {SHUTDOWN_BOUND:?}"),
        };
        eprintln!("warning: the last spans may not have been exported: {unsent}");
    }
}

/// Whether spans are exported (the environment asked and the exporter started).
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// The tracer provider: OTLP/HTTP protobuf over hyper (plain or TLS), batched on
/// the current Tokio runtime, sampled and described as the environment says.
fn provider(
    service: &'static str,
    endpoint: &str,
    timeout: Duration,
) -> Result<SdkTracerProvider, String> {
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .build();
    let client = opentelemetry_http::hyper::HyperClient::new(connector, timeout, None);
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(endpoint)
        .with_timeout(timeout)
        .build()
        .map_err(|e| format!("the OTLP exporter for {endpoint} could not be built: {e}"))?;
    let processor =
        BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
    let named = |key: &str| {
        std::env::var(key).is_ok_and(|v| {
            key == "OTEL_SERVICE_NAME" && !v.trim().is_empty() || v.contains("service.name=")
        })
    };
    let mut resource = Resource::builder().with_attribute(opentelemetry::KeyValue::new(
        "service.version",
        env!("CARGO_PKG_VERSION"),
    ));
    if !named("OTEL_SERVICE_NAME") && !named("OTEL_RESOURCE_ATTRIBUTES") {
        resource = resource.with_service_name(service);
    }
    // The sampler comes from OTEL_TRACES_SAMPLER (parent-based always-on otherwise).
    Ok(SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource.build())
        .build())
}

/// What the OpenTelemetry layer takes: dropgate's own spans (debug level and up:
/// the request path's spans are debug so that logs at the default level skip them),
/// and warnings and errors, which become events on the span they happen in. The
/// exporter's own logs (a failed export, a full queue) go to the logs only: as span
/// events they would feed the exporter its own failures.
fn exported(metadata: &Metadata<'_>) -> bool {
    let target = metadata.target();
    if metadata.is_span() {
        target.starts_with("dropgate") && *metadata.level() <= Level::DEBUG
    } else {
        *metadata.level() <= Level::WARN && !target.starts_with("opentelemetry")
    }
}

/// Makes `span` a child of the caller's span named by W3C `traceparent` (and
/// `tracestate`), when spans are exported. A missing or malformed header leaves
/// `span` a root: the request is served the same. Call it before `span` is
/// first entered.
pub fn continue_trace(span: &Span, traceparent: Option<&str>, tracestate: Option<&str>) {
    if !exporting() || traceparent.is_none() {
        return;
    }
    let carrier = Incoming {
        traceparent,
        tracestate,
    };
    let parent = TraceContextPropagator::new().extract(&carrier);
    let _ = span.set_parent(parent);
}

/// Adds `traceparent` (and `tracestate`) naming `span` to an outgoing request, so
/// that the callee's spans join the trace.
pub fn inject(span: &Span, headers: &mut http::HeaderMap) {
    if !exporting() {
        return;
    }
    TraceContextPropagator::new().inject_context(&span.context(), &mut Outgoing(headers));
}

/// The two W3C trace-context headers of a request.
struct Incoming<'a> {
    traceparent: Option<&'a str>,
    tracestate: Option<&'a str>,
}

impl Extractor for Incoming<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => self.traceparent,
            "tracestate" => self.tracestate,
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

struct Outgoing<'a>(&'a mut http::HeaderMap);

impl Injector for Outgoing<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn export(vars: &[(&str, &str)]) -> Export {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Export::from_env(|name| vars.get(name).cloned())
    }

    fn otlp(endpoint: &str, timeout_ms: u64) -> Export {
        Export::Otlp {
            endpoint: endpoint.into(),
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    fn refused(export: Export, mentioning: &str) {
        match export {
            Export::Refused(why) => assert!(why.contains(mentioning), "{why}"),
            other => panic!("expected a refusal mentioning {mentioning}, got {other:?}"),
        }
    }

    #[test]
    fn nothing_set_exports_nothing() {
        assert_eq!(export(&[]), Export::Off);
        assert_eq!(export(&[("OTEL_SERVICE_NAME", "shop")]), Export::Off);
        assert_eq!(export(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")]), Export::Off);
    }

    #[test]
    fn the_general_endpoint_gets_the_traces_path() {
        let base = "http://collector:4318";
        assert_eq!(
            export(&[("OTEL_EXPORTER_OTLP_ENDPOINT", base)]),
            otlp("http://collector:4318/v1/traces", 10_000)
        );
        assert_eq!(
            export(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")]),
            otlp("http://collector:4318/v1/traces", 10_000)
        );
    }

    #[test]
    fn the_traces_endpoint_is_taken_as_given_and_wins() {
        assert_eq!(
            export(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4318"),
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "https://b/otlp/traces"
                ),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
            ]),
            otlp("https://b/otlp/traces", 2_500)
        );
    }

    #[test]
    fn switched_off_explicitly() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4318");
        assert_eq!(
            export(&[endpoint, ("OTEL_SDK_DISABLED", "true")]),
            Export::Off
        );
        assert_eq!(
            export(&[endpoint, ("OTEL_TRACES_EXPORTER", "none")]),
            Export::Off
        );
        assert_eq!(
            export(&[endpoint, ("OTEL_TRACES_EXPORTER", "otlp")]),
            otlp("http://a:4318/v1/traces", 10_000)
        );
    }

    #[test]
    fn what_dropgate_cannot_do_is_refused_by_name() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4317");
        refused(
            export(&[endpoint, ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]),
            "http/protobuf only",
        );
        refused(
            export(&[
                endpoint,
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
            ]),
            "http/json",
        );
        refused(
            export(&[endpoint, ("OTEL_TRACES_EXPORTER", "zipkin")]),
            "zipkin",
        );
        refused(
            export(&[endpoint, ("OTEL_EXPORTER_OTLP_TIMEOUT", "10s")]),
            "milliseconds",
        );
        refused(
            export(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")]),
            "http://",
        );
    }

    #[test]
    fn the_callers_trace_is_read_from_both_headers() {
        let incoming = Incoming {
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            tracestate: Some("shop=1"),
        };
        let cx = TraceContextPropagator::new().extract(&incoming);
        use opentelemetry::trace::TraceContextExt;
        let remote = cx.span().span_context().clone();
        assert!(remote.is_valid() && remote.is_remote() && remote.is_sampled());
        assert_eq!(
            remote.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(remote.trace_state().get("shop"), Some("1"));
        let malformed = Incoming {
            traceparent: Some("00-not-a-trace"),
            tracestate: None,
        };
        let cx = TraceContextPropagator::new().extract(&malformed);
        assert!(!cx.span().span_context().is_valid());
    }
}
