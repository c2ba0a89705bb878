//! The mutating admission webhook: HTTPS `POST /mutate` with an AdmissionReview
//! v1 of a Pod, answered with [`inject`]'s decision as a JSON patch.
//!
//! Served by every `dropgate-operator run` replica, leader or not: admission must
//! not wait for an election. The certificate and key are read from a directory
//! (a mounted `kubernetes.io/tls` Secret) and read again when they change, so a
//! rotated certificate is served without a restart.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use dropgate_listener::Limits;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::core::v1::Pod;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use super::{Decision, Settings, Skip, inject};

/// The largest AdmissionReview read: a pod is a few KB; the API server's own limit
/// for a request is 3 MiB.
const MAX_REVIEW_BYTES: usize = 3 * 1024 * 1024;
/// What the webhook's clients may hold. Its client is the API server: a few kept-alive
/// connections per API server replica, one review each at a time. Everything else
/// that reaches the port (the chart's NetworkPolicy admits only the API server where
/// the cluster enforces it) is bounded: per address, in time for the handshake, the
/// head and the body (the API server's own webhook timeout is 10 s by default), and
/// in the review bytes held at once over all connections.
const LIMITS: Limits = Limits {
    max_connections: 1024,
    max_per_peer: 128,
    head_timeout: Duration::from_secs(5),
    body_timeout: Duration::from_secs(5),
    max_body: MAX_REVIEW_BYTES,
    body_budget: 64 * 1024 * 1024,
    max_age: Duration::from_secs(600),
    evict_idle: false,
    evict_silent_after: Duration::from_secs(5),
    accept_queue: 1024,
};
/// How often the certificate files are read again (two small files).
const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// Answers one review. Anything the API server sent that is not a pod review is
/// answered with a refusal that says why; a pod is never changed by an error.
pub fn review(
    review: AdmissionReview<DynamicObject>,
    settings: &Settings,
) -> AdmissionReview<DynamicObject> {
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(request) => request,
        Err(e) => return AdmissionResponse::invalid(e.to_string()).into_review(),
    };
    let response = AdmissionResponse::from(&request);
    let Some(object) = request.object.as_ref() else {
        return response.into_review();
    };
    // The pod as sent, for the patch; the typed pod, for the decision.
    let (raw, pod) = match serde_json::to_value(object)
        .and_then(|raw| serde_json::from_value::<Pod>(raw.clone()).map(|pod| (raw, pod)))
    {
        Ok(both) => both,
        Err(e) => return response.deny(format!("not a Pod: {e}")).into_review(),
    };
    let namespace = request
        .namespace
        .as_deref()
        .or(pod.metadata.namespace.as_deref())
        .unwrap_or("default");
    let answer = match inject(&pod, namespace, settings) {
        Ok(Decision::Inject(mutation)) => response
            .with_patch(mutation.patch(&raw))
            .unwrap_or_else(|e| AdmissionResponse::invalid(e.to_string())),
        Ok(Decision::Skip(why)) => {
            tracing::debug!(pod = ?pod.metadata.name, namespace, why = why.as_str(), "not injected");
            if why == Skip::InjectedWithoutWatch {
                let mut response = response;
                response.warnings = Some(vec![why.as_str().to_string()]);
                response
            } else {
                response
            }
        }
        Err(refusal) => response.deny(refusal.to_string()),
    };
    answer.into_review()
}

/// One HTTP request, its body read by the listener: `POST /mutate` with a JSON
/// AdmissionReview.
pub async fn handle(request: Request<Full<Bytes>>, settings: &Settings) -> Response<Full<Bytes>> {
    if request.uri().path() != "/mutate" {
        return text(StatusCode::NOT_FOUND, "only /mutate is served here");
    }
    if request.method() != Method::POST {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "POST an AdmissionReview to /mutate",
        );
    }
    let body = match request.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(never) => match never {},
    };
    answer(&body, settings)
}

/// The answer to a request body (split from [`handle`] for tests without sockets).
pub fn answer(body: &[u8], settings: &Settings) -> Response<Full<Bytes>> {
    let parsed: AdmissionReview<DynamicObject> = match serde_json::from_slice(body) {
        Ok(parsed) => parsed,
        Err(e) => {
            return text(
                StatusCode::BAD_REQUEST,
                &format!("not an AdmissionReview v1 of a Pod: {e}"),
            );
        }
    };
    match serde_json::to_vec(&review(parsed, settings)) {
        Ok(json) => Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(json)))
            .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()))),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

fn text_owned(status: StatusCode, message: String) -> Response<Full<Bytes>> {
    text(status, &message)
}

fn text(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(format!("{message}\n"))));
    *response.status_mut() = status;
    response
}

/// The webhook, bound and with its certificate loaded: a replica whose webhook
/// cannot serve fails at start-up instead of running Ready behind the Service.
pub struct Webhook {
    listener: TcpListener,
    acceptor: TlsAcceptor,
    certificates: Arc<Certificates>,
    settings: Arc<Settings>,
}

impl Webhook {
    /// Binds `addr` and loads `tls.crt` / `tls.key` from `cert_dir`.
    pub async fn bind(
        addr: SocketAddr,
        cert_dir: PathBuf,
        settings: Settings,
    ) -> Result<Self, String> {
        let certificates = Arc::new(Certificates::load(cert_dir)?);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_no_client_auth()
            .with_cert_resolver(certificates.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let listener = dropgate_listener::bind(addr, &LIMITS)
            .map_err(|e| format!("cannot listen on {addr} for the webhook: {e}"))?;
        Ok(Self {
            listener,
            acceptor: TlsAcceptor::from(Arc::new(config)),
            certificates,
            settings: Arc::new(settings),
        })
    }

    /// Serves until `shutdown`, reloading the certificate when its files change.
    pub async fn run(self, shutdown: CancellationToken) {
        tokio::spawn(self.certificates.clone().reload_until(shutdown.clone()));
        if let Ok(addr) = self.listener.local_addr() {
            tracing::info!(listen = %addr, "serving the injection webhook at /mutate");
        }
        let acceptor = self.acceptor.clone();
        let handshake = move |stream| {
            let acceptor = acceptor.clone();
            async move { acceptor.accept(stream).await }
        };
        let settings = self.settings.clone();
        let handler = move |request: Request<Full<Bytes>>| {
            let settings = settings.clone();
            async move { handle(request, &settings).await }
        };
        dropgate_listener::serve(
            self.listener,
            LIMITS,
            handshake,
            handler,
            text_owned,
            shutdown.cancelled_owned(),
        )
        .await;
    }
}

/// The serving certificate, swapped when its files change.
#[derive(Debug)]
struct Certificates {
    dir: PathBuf,
    current: RwLock<(Vec<u8>, Arc<CertifiedKey>)>,
}

impl Certificates {
    fn load(dir: PathBuf) -> Result<Self, String> {
        let (pem, key) = read_pair(&dir)?;
        Ok(Self {
            dir,
            current: RwLock::new((pem, Arc::new(key))),
        })
    }

    async fn reload_until(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(RELOAD_EVERY) => {}
                () = shutdown.cancelled() => return,
            }
            let Ok(pem) = std::fs::read(self.dir.join("tls.crt")).and_then(|cert| {
                std::fs::read(self.dir.join("tls.key")).map(|key| [cert, key].concat())
            }) else {
                continue;
            };
            let unchanged = self
                .current
                .read()
                .map(|current| current.0 == pem)
                .unwrap_or(false);
            if unchanged {
                continue;
            }
            match read_pair(&self.dir) {
                Ok((pem, key)) => {
                    if let Ok(mut current) = self.current.write() {
                        *current = (pem, Arc::new(key));
                        tracing::info!(dir = %self.dir.display(), "webhook certificate reloaded");
                    }
                }
                // A rotation caught half-written: keep serving the old pair.
                Err(error) => tracing::warn!(%error, "webhook certificate not reloaded"),
            }
        }
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok().map(|current| current.1.clone())
    }
}

/// Reads `tls.crt` and `tls.key` (PKCS#1, PKCS#8 or SEC1 keys).
fn read_pair(dir: &Path) -> Result<(Vec<u8>, CertifiedKey), String> {
    let read = |name: &str| {
        std::fs::read(dir.join(name)).map_err(|e| format!("{}: {e}", dir.join(name).display()))
    };
    let (cert_pem, key_pem) = (read("tls.crt")?, read("tls.key")?);
    let certs = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("tls.crt: {e}"))?;
    if certs.is_empty() {
        return Err("tls.crt holds no certificate".into());
    }
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| format!("tls.key: {e}"))?;
    let signer = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|e| format!("tls.key: {e}"))?;
    Ok((
        [cert_pem, key_pem].concat(),
        CertifiedKey::new(certs, signer),
    ))
}
