//! High-availability verification through Google's Memorystore for Redis API.
//!
//! `GET {endpoint}/v1/projects/{p}/locations/{l}/instances/{i}` (Memorystore for
//! Redis) or `.../clusters/{c}` (Memorystore for Redis Cluster) with a bearer token
//! from the GCE/GKE metadata server. Both endpoints are settings, so tests point them
//! at a local server. Every failure becomes a report with a clear reason, never a
//! panic and never a pass.

use std::collections::HashMap;
use std::time::{Duration, Instant};
use tracing::Instrument;

use bytes::Bytes;
use dropgate_api::Tier;
use dropgate_api::drop::MemorystoreInstance;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use tokio::sync::Mutex;

use crate::ha::HaReport;

pub const DEFAULT_ENDPOINT: &str = "https://redis.googleapis.com";
pub const DEFAULT_METADATA_ENDPOINT: &str = "http://metadata.google.internal";

type Https = hyper_rustls::HttpsConnector<HttpConnector>;

/// The Memorystore API client, with its cached access token.
pub struct Memorystore {
    http: Client<Https, Full<Bytes>>,
    endpoint: String,
    metadata_endpoint: String,
    timeout: Duration,
    /// The metadata server's token and when to stop using it.
    token: Mutex<Option<(String, Instant)>>,
    /// Verified answers per instance and Redis URL, and when they were given.
    verdicts: Mutex<HashMap<String, (HaReport, Instant)>>,
}

impl std::fmt::Debug for Memorystore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Memorystore")
            .field("endpoint", &self.endpoint)
            .field("metadata_endpoint", &self.metadata_endpoint)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct Token {
    access_token: String,
    #[serde(default)]
    expires_in: u64,
}

#[derive(Deserialize)]
struct Instance {
    #[serde(default)]
    tier: Option<String>,
    #[serde(default)]
    state: Option<String>,
    /// The primary endpoint's IP address and port.
    #[serde(default)]
    host: Option<String>,
    #[serde(default)]
    port: Option<u16>,
}

/// A Memorystore for Redis Cluster, as the API describes it.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Cluster {
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    replica_count: Option<i64>,
    #[serde(default)]
    shard_count: Option<i64>,
    /// Where clients discover the cluster: the address a drop's URL names.
    #[serde(default)]
    discovery_endpoints: Vec<Endpoint>,
}

#[derive(Deserialize)]
struct Endpoint {
    #[serde(default)]
    address: Option<String>,
    #[serde(default)]
    port: Option<u16>,
}

/// What a drop names in `spec.redis.memorystore`: an instance, or (with
/// `spec.redis.cluster`) a cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Instance,
    Cluster,
}

impl Kind {
    fn collection(self) -> &'static str {
        match self {
            Kind::Instance => "instances",
            Kind::Cluster => "clusters",
        }
    }

    fn word(self) -> &'static str {
        match self {
            Kind::Instance => "instance",
            Kind::Cluster => "cluster",
        }
    }
}

/// How long a verified answer is reused: the API has quotas, and an instance's
/// tier does not change from one reconcile to the next.
pub const VERDICT_TTL: Duration = Duration::from_secs(60);

/// A verdict when none of `endpoints` (the instance's host and port, a cluster's
/// discovery endpoints) is the drop's Redis URL: a drop must not pass the check
/// with somebody else's Redis. The URL's host may be a name for the address.
async fn serves_elsewhere(
    name: &str,
    endpoints: &[(String, u16)],
    redis_url: &str,
) -> Option<HaReport> {
    let url = redis::parse_redis_url(redis_url)?;
    let host = url
        .host_str()?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let port = url.port().unwrap_or(6379);
    if endpoints.is_empty() {
        return Some(HaReport::verdict(
            Tier::Unknown,
            false,
            "InstanceMismatch",
            format!(
                "Memorystore {name} reports no host and port to compare with the drop's Redis {host}:{port}"
            ),
        ));
    }
    let theirs = |ip: &str| endpoints.iter().any(|(h, p)| h == ip && *p == port);
    let same = if theirs(&host) {
        true
    } else {
        match tokio::net::lookup_host((host.as_str(), port)).await {
            Ok(mut addrs) => addrs.any(|a| theirs(&a.ip().to_string())),
            // A name that does not resolve now says nothing about the instance.
            Err(e) => {
                return Some(HaReport::unknown(
                    "RedisHostUnresolved",
                    format!(
                        "cannot resolve the drop's Redis host {host} to compare it with Memorystore {name}: {e}"
                    ),
                ));
            }
        }
    };
    // Its own endpoints are not named: whoever may create a drop could otherwise
    // read any instance's addresses through the operator's credentials.
    (!same).then(|| {
        HaReport::verdict(
            Tier::Unknown,
            false,
            "InstanceMismatch",
            format!(
                "Memorystore {name} does not serve the drop's Redis {host}:{port} (its host and port are others)"
            ),
        )
    })
}

impl Default for Memorystore {
    /// Google's endpoints, as in a GKE pod.
    fn default() -> Self {
        Self::new(
            DEFAULT_ENDPOINT,
            DEFAULT_METADATA_ENDPOINT,
            Duration::from_secs(5),
        )
    }
}

impl Memorystore {
    pub fn new(endpoint: &str, metadata_endpoint: &str, timeout: Duration) -> Self {
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .build();
        Self {
            http: Client::builder(TokioExecutor::new()).build(connector),
            endpoint: endpoint.trim_end_matches('/').to_string(),
            metadata_endpoint: metadata_endpoint.trim_end_matches('/').to_string(),
            timeout,
            token: Mutex::new(None),
            verdicts: Mutex::new(HashMap::new()),
        }
    }

    /// Judges the instance behind `redis_url`: STANDARD_HA, READY and serving that
    /// host and port pass. A verified answer is cached for [`VERDICT_TTL`]; a call
    /// that fails is [`Verdict::Unknown`](crate::ha::Verdict::Unknown), never a pass
    /// and never a fail.
    pub async fn verify(&self, instance: &MemorystoreInstance, redis_url: &str) -> HaReport {
        self.verify_named(Kind::Instance, instance, redis_url).await
    }

    /// Judges the Memorystore for Redis Cluster named by `cluster` (its `instance`
    /// field is the cluster's ID) behind `redis_url`: ACTIVE, at least one replica
    /// per shard, and one of its discovery endpoints the drop's URL pass. Cached
    /// and failed as [`Memorystore::verify`] is.
    pub async fn verify_cluster(&self, cluster: &MemorystoreInstance, redis_url: &str) -> HaReport {
        self.verify_named(Kind::Cluster, cluster, redis_url).await
    }

    async fn verify_named(
        &self,
        kind: Kind,
        instance: &MemorystoreInstance,
        redis_url: &str,
    ) -> HaReport {
        let name = format!(
            "projects/{}/locations/{}/{}/{}",
            instance.project,
            instance.location,
            kind.collection(),
            instance.instance
        );
        let cache_key = format!("{name} {redis_url}");
        if let Some((report, at)) = self.verdicts.lock().await.get(&cache_key)
            && at.elapsed() < VERDICT_TTL
        {
            return report.clone();
        }
        let report = self.ask(kind, &name, redis_url).await;
        if report.is_verified() {
            self.verdicts
                .lock()
                .await
                .insert(cache_key, (report.clone(), Instant::now()));
        }
        report
    }

    async fn ask(&self, kind: Kind, name: &str, redis_url: &str) -> HaReport {
        let url = format!("{}/v1/{name}", self.endpoint);
        // A 401 is a token that expired or was rotated early: fetch a new one and
        // try once more.
        let mut answer = None;
        for _attempt in 0..2 {
            let token = match self.token().await {
                Ok(token) => token,
                Err(message) => return HaReport::unknown("MetadataServerUnavailable", message),
            };
            match self
                .get(&url, &[("authorization", &format!("Bearer {token}"))])
                .await
            {
                Ok((StatusCode::UNAUTHORIZED, _)) => {
                    *self.token.lock().await = None;
                    answer = Some((StatusCode::UNAUTHORIZED, Bytes::new()));
                }
                Ok(other) => {
                    answer = Some(other);
                    break;
                }
                Err(message) => {
                    return HaReport::unknown(
                        "MemorystoreUnreachable",
                        format!("Memorystore API at {url}: {message}"),
                    );
                }
            }
        }
        let Some((status, body)) = answer else {
            return HaReport::unknown("MemorystoreUnreachable", format!("no answer from {url}"));
        };
        match status {
            StatusCode::OK => {}
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                return HaReport::unknown(
                    "MemorystoreAccessDenied",
                    format!(
                        "Memorystore API refused access to {name} ({status}): grant the operator's service account roles/redis.viewer"
                    ),
                );
            }
            StatusCode::NOT_FOUND => {
                return HaReport::verdict(
                    Tier::Unknown,
                    false,
                    match kind {
                        Kind::Instance => "MemorystoreInstanceNotFound",
                        Kind::Cluster => "MemorystoreClusterNotFound",
                    },
                    format!("Memorystore {} {name} does not exist", kind.word()),
                );
            }
            other => {
                return HaReport::unknown(
                    "MemorystoreError",
                    format!("Memorystore API answered {other} for {name}"),
                );
            }
        }
        let unreadable = |e: serde_json::Error| {
            HaReport::unknown(
                "MemorystoreBadResponse",
                format!(
                    "Memorystore API answered for {name} with something that is not {} {}: {e}",
                    if kind == Kind::Instance { "an" } else { "a" },
                    kind.word()
                ),
            )
        };
        match kind {
            Kind::Instance => {
                let parsed: Instance = match serde_json::from_slice(&body) {
                    Ok(parsed) => parsed,
                    Err(e) => return unreadable(e),
                };
                let endpoints: Vec<(String, u16)> =
                    parsed.host.clone().zip(parsed.port).into_iter().collect();
                if let Some(mismatch) = serves_elsewhere(name, &endpoints, redis_url).await {
                    return mismatch;
                }
                judge(name, parsed.tier.as_deref(), parsed.state.as_deref())
            }
            Kind::Cluster => {
                let parsed: Cluster = match serde_json::from_slice(&body) {
                    Ok(parsed) => parsed,
                    Err(e) => return unreadable(e),
                };
                let endpoints: Vec<(String, u16)> = parsed
                    .discovery_endpoints
                    .iter()
                    .filter_map(|e| e.address.clone().zip(e.port))
                    .collect();
                if let Some(mismatch) = serves_elsewhere(name, &endpoints, redis_url).await {
                    return mismatch;
                }
                judge_cluster(name, &parsed)
            }
        }
    }

    async fn token(&self) -> Result<String, String> {
        let mut cached = self.token.lock().await;
        if let Some((token, until)) = cached.as_ref()
            && Instant::now() < *until
        {
            return Ok(token.clone());
        }
        let url = format!(
            "{}/computeMetadata/v1/instance/service-accounts/default/token",
            self.metadata_endpoint
        );
        let (status, body) = self
            .get(&url, &[("metadata-flavor", "Google")])
            .await
            .map_err(|e| format!("metadata server at {url}: {e}"))?;
        if status != StatusCode::OK {
            return Err(format!(
                "metadata server answered {status} for the access token"
            ));
        }
        let token: Token = serde_json::from_slice(&body)
            .map_err(|e| format!("metadata server's token answer is not a token: {e}"))?;
        // Refresh a minute early so a token never expires mid-call; an absurd
        // lifetime from the server is held to an hour.
        let lifetime = Duration::from_secs(token.expires_in.saturating_sub(60).min(3600));
        *cached = Some((token.access_token.clone(), Instant::now() + lifetime));
        Ok(token.access_token)
    }

    async fn get(
        &self,
        url: &str,
        headers: &[(&str, &str)],
    ) -> Result<(StatusCode, Bytes), String> {
        let uri = url.parse::<http::Uri>().ok();
        let span = tracing::debug_span!(
            "GET",
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            http.request.method = "GET",
            url.full = url,
            server.address = uri.as_ref().and_then(|u| u.host()),
            server.port = uri.as_ref().and_then(|u| u.port_u16()).map(i64::from),
            http.response.status_code = tracing::field::Empty,
        );
        let mut request = Request::get(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let mut request = request
            .body(Full::new(Bytes::new()))
            .map_err(|e| format!("bad request: {e}"))?;
        dropgate_telemetry::inject(&span, request.headers_mut());
        let call = async {
            let response = self
                .http
                .request(request)
                .await
                .map_err(|e| e.to_string())?;
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok((status, body))
        };
        let answered = tokio::time::timeout(self.timeout, call)
            .instrument(span.clone())
            .await
            .map_err(|_| format!("no answer within {:?}", self.timeout))
            .and_then(|answered| answered);
        match &answered {
            Ok((status, _)) => {
                span.record("http.response.status_code", i64::from(status.as_u16()));
                if status.is_client_error() || status.is_server_error() {
                    span.record("otel.status_code", "ERROR");
                }
            }
            Err(_) => {
                span.record("otel.status_code", "ERROR");
            }
        }
        answered
    }
}

/// ACTIVE with a replica per shard passes; the rest say what is missing. A cluster
/// being updated or scaled is not counted on: it is a verdict, like an instance that
/// is not READY.
fn judge_cluster(name: &str, cluster: &Cluster) -> HaReport {
    let state = cluster.state.as_deref().unwrap_or("STATE_UNSPECIFIED");
    let replicas = cluster.replica_count.unwrap_or(0);
    let shards = cluster
        .shard_count
        .map_or_else(|| "its".to_string(), |n| n.to_string());
    if state != "ACTIVE" {
        return HaReport::verdict(
            Tier::Unknown,
            false,
            "ClusterNotActive",
            format!("Memorystore cluster {name} is {state}, not ACTIVE"),
        );
    }
    if replicas < 1 {
        return HaReport::verdict(
            Tier::Standalone,
            false,
            "ClusterShardWithoutReplica",
            format!(
                "Memorystore cluster {name} has no replica per shard (replicaCount {replicas}): a failover loses the drop"
            ),
        );
    }
    HaReport::verdict(
        Tier::Replicated,
        true,
        "ClusterReplicated",
        format!(
            "Memorystore cluster {name} is ACTIVE with {replicas} replica(s) for each of {shards} shards"
        ),
    )
}

/// STANDARD_HA and READY pass; the rest say what is missing.
fn judge(name: &str, tier: Option<&str>, state: Option<&str>) -> HaReport {
    let state = state.unwrap_or("STATE_UNSPECIFIED");
    match tier {
        Some("STANDARD_HA") if state == "READY" => HaReport::verdict(
            Tier::StandardHa,
            true,
            "StandardHaReady",
            format!("Memorystore instance {name} is STANDARD_HA and READY"),
        ),
        Some("STANDARD_HA") => HaReport::verdict(
            Tier::StandardHa,
            false,
            "InstanceNotReady",
            format!("Memorystore instance {name} is STANDARD_HA but {state}, not READY"),
        ),
        Some("BASIC") => HaReport::verdict(
            Tier::Basic,
            false,
            "BasicTier",
            format!("Memorystore instance {name} is BASIC tier: no replica to fail over to"),
        ),
        // A tier this operator does not know yet cannot be judged either way.
        other => HaReport::unknown(
            "UnknownTier",
            format!(
                "Memorystore instance {name} reports tier {:?}",
                other.unwrap_or("none")
            ),
        ),
    }
}
