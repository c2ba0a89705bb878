//! Sidecar injection: what `dropgate-operator run` answers at `/mutate` and what
//! `dropgate-operator inject -f` prints, from one pure function.
//!
//! [`inject`] takes a pod (or a pod template, as a pod) and the settings, and says
//! whether to inject and how the pod looks with the sidecar. The HTTP glue
//! ([`webhook`]) and the manifest walker ([`manifest`]) turn that into a JSON patch
//! or a rewritten manifest; neither decides anything.
//!
//! The sidecar is a native sidecar (an init container with `restartPolicy: Always`,
//! Kubernetes 1.29+): it starts before the app, is ready before the app starts, and
//! stops after it.

pub mod manifest;
pub mod webhook;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapProjection, Container, ContainerPort, DownwardAPIProjection,
    DownwardAPIVolumeFile, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction, KeyToPath,
    ObjectFieldSelector, Pod, Probe, ProjectedVolumeSource, ResourceRequirements, SeccompProfile,
    SecretKeySelector, SecurityContext, ServiceAccountTokenProjection, Volume, VolumeMount,
    VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// The injected container's name; a pod that has it is left alone.
pub const CONTAINER: &str = "dropgate-sidecar";
/// The label that opts a pod in (`"true"`) or out (`"false"`).
pub const INJECT_LABEL: &str = "dropgate.io/inject";
/// Set on every injected pod: the operator version that injected it.
pub const INJECTED: &str = "dropgate.io/injected";
/// Per-pod overrides an app team may set.
pub const IMAGE: &str = "dropgate.io/image";
pub const CPU: &str = "dropgate.io/sidecar-cpu";
pub const MEMORY: &str = "dropgate.io/sidecar-memory";
pub const PORT: &str = "dropgate.io/port";
pub const DATABASE_SECRET: &str = "dropgate.io/database-secret";
/// The opt-in to a per-pod SQLite ledger (`per-pod`) for a pod with no ledger Secret.
pub const LEDGER: &str = "dropgate.io/ledger";
/// The one value [`LEDGER`] takes.
pub const PER_POD: &str = "per-pod";
/// The sidecar's `--wait-replicas`: Redis replicas that acknowledge an admission
/// before its 201 (narrows what a failover can lose).
pub const WAIT_REPLICAS: &str = "dropgate.io/wait-replicas";
/// The most replicas [`WAIT_REPLICAS`] may ask for: more than any Redis deployment
/// the operator accepts runs, so a larger number is a typo.
const MOST_REPLICAS: u32 = 16;
/// Every annotation that tunes the sidecar; another `dropgate.io/` one is a typo.
const TUNING: [&str; 7] = [
    IMAGE,
    CPU,
    MEMORY,
    PORT,
    DATABASE_SECRET,
    LEDGER,
    WAIT_REPLICAS,
];
/// Where the probes and scrapes reach the sidecar from outside the pod.
pub const HEALTH_PORT: u16 = 7071;
/// The default port of the API on 127.0.0.1.
pub const API_PORT: u16 = 7070;
/// The emptyDir volume of the per-pod SQLite ledger.
const LEDGER_VOLUME: &str = "dropgate-ledger";
const LEDGER_DIR: &str = "/var/lib/dropgate";
/// The sidecar's own service-account token, CA and namespace, where a client looks
/// for them in a pod. Its own volume: the API server mounts the pod's token into the
/// containers it has before the webhook adds this one (and into none when the pod
/// or its service account turns the mount off), and the sidecar watches its drops
/// there (`DROPGATE_WATCH_DROPS`).
const API_VOLUME: &str = "dropgate-api-access";
/// The sidecar's `--watch-drops`.
const WATCH_DROPS: &str = "DROPGATE_WATCH_DROPS";
const API_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// What the platform team configures (the operator's `DROPGATE_SIDECAR_*`
/// environment, set by the chart).
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct Settings {
    /// The sidecar image (it holds both binaries).
    #[arg(long = "sidecar-image", env = "DROPGATE_SIDECAR_IMAGE", default_value = concat!("dropgate:", env!("CARGO_PKG_VERSION")))]
    pub image: String,
    /// The sidecar's imagePullPolicy (Always, IfNotPresent or Never).
    #[arg(
        long = "sidecar-image-pull-policy",
        env = "DROPGATE_SIDECAR_IMAGE_PULL_POLICY",
        default_value = "IfNotPresent"
    )]
    pub image_pull_policy: String,
    /// The Secret, in the app's namespace, whose key holds the Redis URL.
    #[arg(
        long = "sidecar-redis-secret",
        env = "DROPGATE_SIDECAR_REDIS_SECRET",
        default_value = "dropgate-redis"
    )]
    pub redis_secret: String,
    /// The key of that Secret that holds the Redis URL.
    #[arg(
        long = "sidecar-redis-secret-key",
        env = "DROPGATE_SIDECAR_REDIS_SECRET_KEY",
        default_value = "url"
    )]
    pub redis_secret_key: String,
    /// The sidecars' Redis is a Redis Cluster (`--redis-cluster` for each).
    #[arg(
        long = "sidecar-redis-cluster",
        env = "DROPGATE_SIDECAR_REDIS_CLUSTER",
        default_value_t = false
    )]
    pub redis_cluster: bool,
    /// A Secret holding a PostgreSQL ledger URL, shared by every injected pod; without
    /// it a pod needs its own `dropgate.io/database-secret`, or `dropgate.io/ledger:
    /// per-pod` (a SQLite ledger on an emptyDir, for a workload of one pod).
    #[arg(
        long = "sidecar-database-secret",
        env = "DROPGATE_SIDECAR_DATABASE_SECRET"
    )]
    pub database_secret: Option<String>,
    /// The key of the ledger's Secret (shared or per pod) that holds its URL.
    #[arg(
        long = "sidecar-database-secret-key",
        env = "DROPGATE_SIDECAR_DATABASE_SECRET_KEY",
        default_value = "url"
    )]
    pub database_secret_key: String,
    /// CPU request of the sidecar.
    #[arg(
        long = "sidecar-cpu",
        env = "DROPGATE_SIDECAR_CPU",
        default_value = "50m",
        value_parser = cpu_flag
    )]
    pub cpu: String,
    /// Memory request of the sidecar (and its limit, unless --sidecar-memory-limit).
    #[arg(
        long = "sidecar-memory",
        env = "DROPGATE_SIDECAR_MEMORY",
        default_value = "64Mi",
        value_parser = memory_flag
    )]
    pub memory: String,
    /// Memory limit of the sidecar; by default its memory request. A pod's
    /// dropgate.io/sidecar-memory sets both.
    #[arg(
        long = "sidecar-memory-limit",
        env = "DROPGATE_SIDECAR_MEMORY_LIMIT",
        value_parser = memory_flag
    )]
    pub memory_limit: Option<String>,
    /// CPU limit of the sidecar; none by default: a CPU limit throttles the answers
    /// a sale waits on, at its busiest second.
    #[arg(
        long = "sidecar-cpu-limit",
        env = "DROPGATE_SIDECAR_CPU_LIMIT",
        value_parser = cpu_flag
    )]
    pub cpu_limit: Option<String>,
    /// Size limit of a per-pod SQLite ledger's emptyDir (the kubelet evicts a pod
    /// whose volume grows past it). The ledger forgets sales that are over after
    /// the sidecar's --ledger-retention, so it stays small.
    #[arg(
        long = "sidecar-ledger-size-limit",
        env = "DROPGATE_SIDECAR_LEDGER_SIZE_LIMIT",
        default_value = "1Gi",
        value_parser = memory_flag
    )]
    pub ledger_size_limit: String,
    /// How long the sidecars' ledgers keep a sale that is over (the sidecar's
    /// --ledger-retention: 30d, 12h, ...; at least 1h). Unset: the sidecar's default
    /// (30d).
    #[arg(
        long = "sidecar-ledger-retention",
        env = "DROPGATE_SIDECAR_LEDGER_RETENTION",
        value_parser = retention_flag
    )]
    pub ledger_retention: Option<String>,
    /// How the injected sidecars write their log lines: text, or json (one object
    /// per line).
    #[arg(
        long = "sidecar-log-format",
        env = "DROPGATE_SIDECAR_LOG_FORMAT",
        default_value = "text"
    )]
    pub log_format: dropgate_telemetry::LogFormat,
    /// Traces of the injected sidecars.
    #[command(flatten)]
    pub traces: SidecarTraces,
    /// The operator's own namespace: never injected.
    #[arg(
        long = "operator-namespace",
        env = "POD_NAMESPACE",
        default_value = "dropgate-system"
    )]
    pub operator_namespace: String,
}

/// Where the injected sidecars send traces (the chart's `tracing` values).
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct SidecarTraces {
    /// The OTLP/HTTP endpoint, given to each sidecar as OTEL_EXPORTER_OTLP_ENDPOINT;
    /// `$(HOST_IP)` in it is the pod's node (a collector on every node). Unset:
    /// the sidecars export no traces.
    #[arg(long = "sidecar-otlp-endpoint", env = "DROPGATE_SIDECAR_OTLP_ENDPOINT")]
    pub endpoint: Option<String>,
    /// OTEL_TRACES_SAMPLER of the sidecars.
    #[arg(
        long = "sidecar-trace-sampler",
        env = "DROPGATE_SIDECAR_TRACE_SAMPLER",
        default_value = "parentbased_traceidratio",
        value_parser = [
            "always_on", "always_off", "traceidratio",
            "parentbased_always_on", "parentbased_always_off", "parentbased_traceidratio",
        ]
    )]
    pub sampler: String,
    /// OTEL_TRACES_SAMPLER_ARG: the share of traces a ratio sampler keeps, 0 to 1.
    #[arg(
        long = "sidecar-trace-sampler-arg",
        env = "DROPGATE_SIDECAR_TRACE_SAMPLER_ARG",
        default_value = "0.1",
        value_parser = ratio
    )]
    pub sampler_arg: String,
}

fn ratio(text: &str) -> Result<String, String> {
    match text.trim().parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(text.trim().to_string()),
        _ => Err(format!("{text} is not a ratio between 0 and 1")),
    }
}

impl SidecarTraces {
    /// The sidecar's OpenTelemetry environment; nothing without an endpoint. It
    /// comes after DROPGATE_NAMESPACE, which it refers to.
    fn env(&self) -> Vec<EnvVar> {
        let Some(endpoint) = &self.endpoint else {
            return Vec::new();
        };
        let field = |name: &str, path: &str| EnvVar {
            name: name.into(),
            value: None,
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: path.into(),
                    api_version: None,
                }),
                ..EnvVarSource::default()
            }),
        };
        let value = |name: &str, value: &str| EnvVar {
            name: name.into(),
            value: Some(value.into()),
            value_from: None,
        };
        vec![
            field("HOST_IP", "status.hostIP"),
            field("DROPGATE_POD_NAME", "metadata.name"),
            value("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
            value("OTEL_SERVICE_NAME", "dropgate-sidecar"),
            value(
                "OTEL_RESOURCE_ATTRIBUTES",
                &format!(
                    "k8s.namespace.name=$(DROPGATE_NAMESPACE),k8s.pod.name=$(DROPGATE_POD_NAME),k8s.container.name={CONTAINER}"
                ),
            ),
            value("OTEL_TRACES_SAMPLER", &self.sampler),
            value("OTEL_TRACES_SAMPLER_ARG", &self.sampler_arg),
        ]
    }
}

/// What [`inject`] decided.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Add this to the pod.
    Inject(Box<Mutation>),
    /// Left alone, and why.
    Skip(Skip),
}

/// What injection adds to a pod: the sidecar first among the init containers, the
/// SQLite ledger's emptyDir when there is no PostgreSQL ledger, and the
/// `dropgate.io/injected` annotation. Applied to the pod's JSON as it came, so
/// that fields this operator's API types do not know survive untouched.
#[derive(Clone, Debug, PartialEq)]
pub struct Mutation {
    pub sidecar: Container,
    pub ledger_volume: Option<Volume>,
    /// The sidecar's access to the API server (see [`API_VOLUME`]).
    pub api_volume: Volume,
}

impl Mutation {
    /// The JSON patch (RFC 6902) that makes `pod` (the object as sent) injected:
    /// additions only, never a rewrite of what the pod has.
    pub fn patch(&self, pod: &serde_json::Value) -> json_patch::Patch {
        use json_patch::jsonptr::PointerBuf;
        use json_patch::{AddOperation, PatchOperation};
        let add = |path: &[&str], value: serde_json::Value| {
            PatchOperation::Add(AddOperation {
                path: PointerBuf::from_tokens(path.iter().copied()),
                value,
            })
        };
        let has = |path: &[&str]| path.iter().try_fold(pod, |v, key| v.get(*key)).is_some();
        let sidecar = serde_json::to_value(&self.sidecar).unwrap_or_default();
        let mut ops = Vec::new();
        if has(&["spec", "initContainers"]) {
            ops.push(add(&["spec", "initContainers", "0"], sidecar));
        } else {
            ops.push(add(
                &["spec", "initContainers"],
                serde_json::Value::Array(vec![sidecar]),
            ));
        }
        let volumes: Vec<serde_json::Value> = self
            .ledger_volume
            .iter()
            .chain(std::iter::once(&self.api_volume))
            .map(|volume| serde_json::to_value(volume).unwrap_or_default())
            .collect();
        if has(&["spec", "volumes"]) {
            for volume in volumes {
                ops.push(add(&["spec", "volumes", "-"], volume));
            }
        } else {
            ops.push(add(&["spec", "volumes"], serde_json::Value::Array(volumes)));
        }
        let version = serde_json::Value::String(env!("CARGO_PKG_VERSION").into());
        if has(&["metadata", "annotations"]) {
            ops.push(add(&["metadata", "annotations", INJECTED], version));
        } else {
            ops.push(add(
                &["metadata", "annotations"],
                serde_json::json!({ INJECTED: version }),
            ));
        }
        json_patch::Patch(ops)
    }

    /// `pod` (a Pod or a pod template, as JSON) with the injection applied.
    pub fn apply(&self, pod: &mut serde_json::Value) -> Result<(), json_patch::PatchError> {
        json_patch::patch(pod, &self.patch(pod))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    AlreadyInjected,
    /// The pod has a dropgate-sidecar injected before sidecars watched their drops
    /// (an old `inject -f` manifest): left as it is, with a warning.
    InjectedWithoutWatch,
    OptedOut,
    ProtectedNamespace,
}

impl Skip {
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::AlreadyInjected => "the pod already has dropgate-sidecar",
            Skip::InjectedWithoutWatch => {
                "this pod's dropgate-sidecar was injected by an older dropgate: it does not watch its drops, so an older sidecar image may sell on a config changed while it cannot reach Redis, and this version's admits nothing on its fallback then; inject the manifest again (dropgate-operator inject -f)"
            }
            Skip::OptedOut => "the pod is labelled dropgate.io/inject: \"false\"",
            Skip::ProtectedNamespace => {
                "kube-system and the operator's namespace are never injected"
            }
        }
    }
}

/// An annotation that cannot be honoured; the pod is refused rather than started
/// with a sidecar that is not what its team asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("annotation {annotation}: {value:?} {problem}")]
pub struct AnnotationError {
    pub annotation: &'static str,
    pub value: String,
    pub problem: &'static str,
}

/// Why a pod that asked for the sidecar is refused: the sidecar it would get could
/// not keep what dropgate promises, so the pod is not started with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    Annotation(#[from] AnnotationError),
    /// Neither a ledger Secret nor the per-pod opt-in.
    #[error(
        "the pod names no ledger. Add to the pod template's annotations {DATABASE_SECRET}: \
         <a Secret in this namespace holding a postgres:// URL shared by all replicas, under \
         the key the operator's --sidecar-database-secret-key names, \"url\" by default> (or set the chart's sidecar.database.existingSecret), or {LEDGER}: {PER_POD} \
         for a workload of exactly one pod that is not replaced mid-sale. Why: a sale is \
         recorded by one ledger; a per-pod SQLite ledger records it for one pod only, so other \
         replicas would answer unavailable and a Redis that lost writes could not be rebuilt \
         from part of the sale"
    )]
    NoLedger,
    /// A pod on the node's network: the API's loopback would be the node's, shared by
    /// every such pod on it.
    #[error(
        "the pod uses hostNetwork: the sidecar's API would listen on the node's loopback, \
         reachable by every hostNetwork pod on the node and clashing with their ports; \
         dropgate is not injected into hostNetwork pods"
    )]
    HostNetwork,
}

/// Decides for `pod` in `namespace`. Which pods are asked about is the webhook
/// configuration's business (its selectors); this refuses only what must never be
/// injected, whoever asks.
pub fn inject(pod: &Pod, namespace: &str, settings: &Settings) -> Result<Decision, Refusal> {
    let labels = pod.metadata.labels.as_ref();
    if namespace == "kube-system" || namespace == settings.operator_namespace {
        return Ok(Decision::Skip(Skip::ProtectedNamespace));
    }
    if labels.and_then(|l| l.get(INJECT_LABEL)).map(String::as_str) == Some("false") {
        return Ok(Decision::Skip(Skip::OptedOut));
    }
    let spec = pod.spec.clone().unwrap_or_default();
    let present = spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .find(|c| c.name == CONTAINER);
    if let Some(present) = present {
        let watches = present
            .env
            .iter()
            .flatten()
            .any(|e| e.name == WATCH_DROPS && e.value.as_deref() == Some("true"));
        return Ok(Decision::Skip(if watches {
            Skip::AlreadyInjected
        } else {
            Skip::InjectedWithoutWatch
        }));
    }
    if spec.host_network == Some(true) {
        return Err(Refusal::HostNetwork);
    }
    let tuning = Tuning::read(pod.metadata.annotations.as_ref(), settings)?;
    if tuning.database_secret.is_none() && !tuning.per_pod {
        return Err(Refusal::NoLedger);
    }
    Ok(Decision::Inject(Box::new(Mutation {
        sidecar: sidecar(&tuning, settings),
        ledger_volume: tuning.database_secret.is_none().then(|| Volume {
            name: LEDGER_VOLUME.into(),
            empty_dir: Some(EmptyDirVolumeSource {
                size_limit: Some(Quantity(settings.ledger_size_limit.clone())),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        }),
        api_volume: api_volume(),
    })))
}

/// A projected volume of what an in-cluster client reads: a token of the pod's
/// service account, the cluster's CA and the namespace, as the API server's own
/// `kube-api-access` volume has them. The token lives an hour (the kubelet renews it
/// before then and the client reads the file again); not 3607 s, the value the API
/// server stretches to a year for clients that cannot reload a token.
fn api_volume() -> Volume {
    let projection = VolumeProjection::default;
    Volume {
        name: API_VOLUME.into(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(vec![
                VolumeProjection {
                    service_account_token: Some(ServiceAccountTokenProjection {
                        path: "token".into(),
                        expiration_seconds: Some(3600),
                        audience: None,
                    }),
                    ..projection()
                },
                VolumeProjection {
                    config_map: Some(ConfigMapProjection {
                        name: "kube-root-ca.crt".into(),
                        items: Some(vec![KeyToPath {
                            key: "ca.crt".into(),
                            path: "ca.crt".into(),
                            mode: None,
                        }]),
                        optional: None,
                    }),
                    ..projection()
                },
                VolumeProjection {
                    downward_api: Some(DownwardAPIProjection {
                        items: Some(vec![DownwardAPIVolumeFile {
                            path: "namespace".into(),
                            field_ref: Some(ObjectFieldSelector {
                                api_version: Some("v1".into()),
                                field_path: "metadata.namespace".into(),
                            }),
                            ..DownwardAPIVolumeFile::default()
                        }]),
                    }),
                    ..projection()
                },
            ]),
            default_mode: Some(0o644),
        }),
        ..Volume::default()
    }
}

/// The settings after the pod's annotations.
struct Tuning {
    image: String,
    cpu: String,
    memory: String,
    memory_limit: String,
    port: u16,
    database_secret: Option<String>,
    /// The pod asked for a per-pod SQLite ledger (and has no ledger Secret then).
    per_pod: bool,
    /// Replicas an admission waits for (0: none).
    wait_replicas: u32,
}

impl Tuning {
    fn read(
        annotations: Option<&BTreeMap<String, String>>,
        settings: &Settings,
    ) -> Result<Self, AnnotationError> {
        if let Some((name, value)) = annotations.into_iter().flatten().find(|(name, _)| {
            name.starts_with("dropgate.io/")
                && !TUNING.contains(&name.as_str())
                && *name != INJECTED
        }) {
            return Err(AnnotationError {
                annotation: "dropgate.io/*",
                value: format!("{name}: {value}"),
                problem: "is not an annotation dropgate knows (dropgate.io/image, sidecar-cpu, sidecar-memory, port, database-secret, ledger, wait-replicas)",
            });
        }
        let get = |name: &str| annotations.and_then(|a| a.get(name));
        let bad = |annotation, value: &String, problem| AnnotationError {
            annotation,
            value: value.clone(),
            problem,
        };
        let image = match get(IMAGE) {
            Some(v) if !is_image_reference(v) => {
                return Err(bad(
                    IMAGE,
                    v,
                    "is not an image reference (registry/name:tag, the name in lowercase)",
                ));
            }
            Some(v) => v.clone(),
            None => settings.image.clone(),
        };
        let cpu = match get(CPU) {
            Some(v) if !quantity(v, false).is_some_and(|cores| (0.001..=64.0).contains(&cores)) => {
                return Err(bad(
                    CPU,
                    v,
                    "is not a CPU quantity from 1m to 64 (such as 100m or 0.5)",
                ));
            }
            Some(v) => v.clone(),
            None => settings.cpu.clone(),
        };
        let memory = match get(MEMORY) {
            Some(v)
                if !quantity(v, true)
                    .is_some_and(|bytes| (16.0 * MI..=64.0 * GI).contains(&bytes)) =>
            {
                return Err(bad(
                    MEMORY,
                    v,
                    "is not a memory quantity from 16Mi to 64Gi (such as 64Mi or 1Gi)",
                ));
            }
            Some(v) => v.clone(),
            None => settings.memory.clone(),
        };
        // The pod's own memory is its request and its limit; else the chart's.
        let memory_limit = match get(MEMORY) {
            Some(v) => v.clone(),
            None => settings
                .memory_limit
                .clone()
                .unwrap_or_else(|| settings.memory.clone()),
        };
        let port = match get(PORT) {
            Some(v) => match v.parse::<u16>() {
                Ok(port) if port != 0 && port != HEALTH_PORT => port,
                _ => {
                    return Err(bad(
                        PORT,
                        v,
                        "is not a port from 1 to 65535 other than 7071 (the sidecar's health port)",
                    ));
                }
            },
            None => API_PORT,
        };
        let per_pod = match get(LEDGER) {
            Some(v) if v == PER_POD => true,
            Some(v) => {
                return Err(bad(
                    LEDGER,
                    v,
                    "is not a ledger dropgate knows: per-pod (a SQLite ledger for a workload of one replica); a shared ledger is named by dropgate.io/database-secret",
                ));
            }
            None => false,
        };
        let wait_replicas = match get(WAIT_REPLICAS) {
            Some(v) => match v.parse::<u32>() {
                // The sidecar refuses WAIT on a cluster connection (one per node):
                // refused here, where the pod is made, not by a crash-looping pod.
                Ok(n) if n > 0 && settings.redis_cluster => {
                    return Err(bad(
                        WAIT_REPLICAS,
                        v,
                        "asks the sidecar to wait for replicas, which it cannot on a Redis Cluster (the operator runs with --sidecar-redis-cluster)",
                    ));
                }
                Ok(n) if n <= MOST_REPLICAS => n,
                _ => {
                    return Err(bad(
                        WAIT_REPLICAS,
                        v,
                        "is not a number of Redis replicas from 0 to 16",
                    ));
                }
            },
            None => 0,
        };
        let database_secret = match get(DATABASE_SECRET) {
            Some(v) if !dropgate_api::keys::is_object_name(v) && !is_subdomain(v) => {
                return Err(bad(DATABASE_SECRET, v, "is not a Secret name"));
            }
            Some(v) if per_pod => {
                return Err(bad(
                    DATABASE_SECRET,
                    v,
                    "names a shared ledger, and dropgate.io/ledger: per-pod asks for a per-pod one: keep one of the two",
                ));
            }
            Some(v) => Some(v.clone()),
            // The pod's own choice of a per-pod ledger stands over the chart's default.
            None if per_pod => None,
            None => settings.database_secret.clone(),
        };
        Ok(Self {
            image,
            cpu,
            memory,
            memory_limit,
            port,
            database_secret,
            per_pod,
            wait_replicas,
        })
    }
}

fn sidecar(tuning: &Tuning, settings: &Settings) -> Container {
    let secret = |name: &str, key: &str| EnvVarSource {
        secret_key_ref: Some(SecretKeySelector {
            name: name.into(),
            key: key.into(),
            optional: Some(false),
        }),
        ..EnvVarSource::default()
    };
    let value = |name: &str, value: String| EnvVar {
        name: name.into(),
        value: Some(value),
        value_from: None,
    };
    let database = match &tuning.database_secret {
        Some(name) => EnvVar {
            name: "DROPGATE_DATABASE_URL".into(),
            value: None,
            value_from: Some(secret(name, &settings.database_secret_key)),
        },
        None => value(
            "DROPGATE_DATABASE_URL",
            format!("sqlite://{LEDGER_DIR}/ledger.db"),
        ),
    };
    let probe = |path: &str, failures: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("dropgate-health".into()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(5),
        timeout_seconds: Some(3),
        failure_threshold: Some(failures),
        ..Probe::default()
    };
    let quantity = |q: &str| Quantity(q.to_string());
    Container {
        name: CONTAINER.into(),
        image: Some(tuning.image.clone()),
        image_pull_policy: Some(settings.image_pull_policy.clone()),
        command: Some(vec!["dropgate-sidecar".into()]),
        env: Some(
            vec![
                EnvVar {
                    name: "DROPGATE_NAMESPACE".into(),
                    value: None,
                    value_from: Some(EnvVarSource {
                        field_ref: Some(ObjectFieldSelector {
                            field_path: "metadata.namespace".into(),
                            api_version: None,
                        }),
                        ..EnvVarSource::default()
                    }),
                },
                EnvVar {
                    name: "DROPGATE_REDIS_URL".into(),
                    value: None,
                    value_from: Some(secret(&settings.redis_secret, &settings.redis_secret_key)),
                },
                database,
                value("DROPGATE_LISTEN", format!("127.0.0.1:{}", tuning.port)),
                value("DROPGATE_HEALTH_LISTEN", format!("0.0.0.0:{HEALTH_PORT}")),
                value(WATCH_DROPS, "true".into()),
            ]
            .into_iter()
            .chain(
                settings
                    .redis_cluster
                    .then(|| value("DROPGATE_REDIS_CLUSTER", "true".into())),
            )
            .chain(
                settings
                    .ledger_retention
                    .as_ref()
                    .map(|retention| value("DROPGATE_LEDGER_RETENTION", retention.clone())),
            )
            .chain(
                (settings.log_format == dropgate_telemetry::LogFormat::Json)
                    .then(|| value("DROPGATE_LOG_FORMAT", "json".into())),
            )
            .chain(
                (tuning.wait_replicas > 0)
                    .then(|| value("DROPGATE_WAIT_REPLICAS", tuning.wait_replicas.to_string())),
            )
            .chain(settings.traces.env())
            .collect(),
        ),
        ports: Some(vec![ContainerPort {
            name: Some("dropgate-health".into()),
            container_port: i32::from(HEALTH_PORT),
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        }]),
        startup_probe: Some(probe("/readyz", 60)),
        readiness_probe: Some(probe("/readyz", 3)),
        liveness_probe: Some(probe("/healthz", 3)),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), quantity(&tuning.cpu)),
                ("memory".to_string(), quantity(&tuning.memory)),
            ])),
            limits: Some(
                std::iter::once(("memory".to_string(), quantity(&tuning.memory_limit)))
                    .chain(
                        settings
                            .cpu_limit
                            .as_deref()
                            .map(|cpu| ("cpu".to_string(), quantity(cpu))),
                    )
                    .collect(),
            ),
            ..ResourceRequirements::default()
        }),
        // Native sidecar: starts before the app's containers and outlives them.
        restart_policy: Some("Always".into()),
        security_context: Some(SecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(65532),
            read_only_root_filesystem: Some(true),
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                add: None,
            }),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                localhost_profile: None,
            }),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(
            tuning
                .database_secret
                .is_none()
                .then(|| VolumeMount {
                    name: LEDGER_VOLUME.into(),
                    mount_path: LEDGER_DIR.into(),
                    ..VolumeMount::default()
                })
                .into_iter()
                .chain(std::iter::once(VolumeMount {
                    name: API_VOLUME.into(),
                    mount_path: API_DIR.into(),
                    read_only: Some(true),
                    ..VolumeMount::default()
                }))
                .collect(),
        ),
        ..Container::default()
    }
}

/// A flag's retention, as the sidecar takes it (refused here, not by each sidecar
/// at its start).
fn retention_flag(text: &str) -> Result<String, String> {
    dropgate_api::config::parse_retention(text).map(|_| text.to_string())
}

/// A flag's CPU quantity (such as 100m or 0.5).
fn cpu_flag(text: &str) -> Result<String, String> {
    quantity(text, false)
        .map(|_| text.to_string())
        .ok_or_else(|| format!("{text:?} is not a CPU quantity (such as 100m or 0.5)"))
}

/// A flag's memory or storage quantity (such as 64Mi or 1Gi).
fn memory_flag(text: &str) -> Result<String, String> {
    quantity(text, true)
        .map(|_| text.to_string())
        .ok_or_else(|| format!("{text:?} is not a memory quantity (such as 64Mi or 1Gi)"))
}

const MI: f64 = 1024.0 * 1024.0;
const GI: f64 = 1024.0 * MI;

/// A Kubernetes quantity as a sidecar's request may use, as a number (cores, or
/// bytes for memory): a decimal with an optional suffix (binary ones only for
/// memory). `None` when it is not one.
fn quantity(text: &str, memory: bool) -> Option<f64> {
    let digits_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(digits_end);
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
        return None;
    }
    let number: f64 = number.parse().ok().filter(|n: &f64| *n > 0.0)?;
    let scale = match (memory, suffix) {
        (_, "") => 1.0,
        (false, "m") => 0.001,
        (true, "k") => 1e3,
        (true, "M") => 1e6,
        (true, "G") => 1e9,
        (true, "T") => 1e12,
        (true, "Ki") => 1024.0,
        (true, "Mi") => MI,
        (true, "Gi") => GI,
        (true, "Ti") => 1024.0 * GI,
        _ => return None,
    };
    Some(number * scale)
}

/// An image reference the kubelet can pull: `[registry[:port]/]path[:tag][@digest]`,
/// the path in lowercase (a registry host may have capitals).
fn is_image_reference(text: &str) -> bool {
    if text.is_empty() || text.len() > 512 {
        return false;
    }
    let (name, digest) = match text.split_once('@') {
        Some((name, digest)) => (name, Some(digest)),
        None => (text, None),
    };
    let digest_ok = digest.is_none_or(|d| {
        d.split_once(':').is_some_and(|(algo, hex)| {
            !algo.is_empty() && hex.len() >= 32 && hex.chars().all(|c| c.is_ascii_hexdigit())
        })
    });
    let (registry, path) = match name.split_once('/') {
        Some((first, rest)) if first.contains(['.', ':']) || first == "localhost" => {
            (Some(first), rest)
        }
        _ => (None, name),
    };
    let (path, tag) = match path.rsplit_once(':') {
        Some((path, tag)) => (path, Some(tag)),
        None => (path, None),
    };
    let registry_ok = registry.is_none_or(|r| {
        r.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':'))
    });
    let path_ok = !path.is_empty()
        && path.split('/').all(|part| {
            part.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                && part.chars().all(|c| {
                    c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-')
                })
        });
    let tag_ok = tag.is_none_or(|t| {
        !t.is_empty()
            && t.len() <= 128
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    });
    digest_ok && registry_ok && path_ok && tag_ok
}

/// A DNS subdomain name (Secret names may contain dots).
fn is_subdomain(name: &str) -> bool {
    !name.is_empty() && name.len() <= 253 && name.split('.').all(dropgate_api::keys::is_object_name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use serde_json::json;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        settings: Settings,
    }

    /// The defaults, as the chart leaves them.
    fn settings() -> Settings {
        Cli::parse_from(["test", "--operator-namespace", "dropgate-system"]).settings
    }

    #[test]
    fn sidecars_write_json_logs_when_the_chart_asks() {
        let labelled = json!({"dropgate.io/inject": "true"});
        let annotations = json!({LEDGER: "per-pod"});
        let sidecar_env = |settings: &Settings| {
            let Ok(Decision::Inject(mutation)) = inject(
                &bare_pod(labelled.clone(), annotations.clone()),
                "shop",
                settings,
            ) else {
                panic!("injected");
            };
            serde_json::to_string(&mutation.sidecar).expect("json")
        };
        assert!(!sidecar_env(&settings()).contains("DROPGATE_LOG_FORMAT"));
        let json_logs = Cli::parse_from([
            "test",
            "--operator-namespace",
            "dropgate-system",
            "--sidecar-log-format",
            "json",
        ])
        .settings;
        let patched = sidecar_env(&json_logs);
        assert!(
            patched.contains(r#""name":"DROPGATE_LOG_FORMAT","value":"json""#),
            "{patched}"
        );
    }

    /// A pod built from JSON: labels, annotations and containers as given. A pod
    /// that names no ledger opts into a per-pod one (the tests of that choice build
    /// their pods with [`bare_pod`]).
    fn pod(labels: serde_json::Value, mut annotations: serde_json::Value) -> Pod {
        if let Some(map) = annotations.as_object_mut()
            && !map.contains_key(DATABASE_SECRET)
            && !map.contains_key(LEDGER)
        {
            map.insert(LEDGER.into(), PER_POD.into());
        }
        bare_pod(labels, annotations)
    }

    /// A pod built from JSON exactly as given.
    fn bare_pod(labels: serde_json::Value, annotations: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "shop-1", "labels": labels, "annotations": annotations},
            "spec": {"containers": [{"name": "app", "image": "shop:1"}]}
        }))
        .expect("pod")
    }

    /// `pod` as the API server stores it after the webhook's patch.
    fn injected(pod: &Pod, namespace: &str) -> Pod {
        match inject(pod, namespace, &settings()).expect("no refusal") {
            Decision::Inject(mutation) => {
                let mut value = serde_json::to_value(pod).expect("json");
                mutation.apply(&mut value).expect("the patch applies");
                serde_json::from_value(value).expect("a pod")
            }
            Decision::Skip(why) => panic!("skipped: {}", why.as_str()),
        }
    }

    fn sidecar_of(pod: &Pod) -> Container {
        let spec = pod.spec.as_ref().expect("spec");
        spec.init_containers.as_ref().expect("init containers")[0].clone()
    }

    fn env(container: &Container, name: &str) -> serde_json::Value {
        let var = container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .unwrap_or_else(|| panic!("{name}"));
        serde_json::to_value(var).expect("json")
    }

    #[test]
    fn a_labelled_pod_gets_a_native_sidecar_that_passes_restricted() {
        let pod = injected(
            &pod(json!({"dropgate.io/inject": "true"}), json!({})),
            "shop",
        );
        let sidecar = sidecar_of(&pod);
        assert_eq!(sidecar.name, CONTAINER);
        assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"));
        assert_eq!(
            sidecar.image.as_deref(),
            Some(concat!("dropgate:", env!("CARGO_PKG_VERSION")))
        );
        let security = serde_json::to_value(sidecar.security_context.as_ref()).expect("json");
        assert_eq!(
            security,
            json!({"runAsNonRoot": true, "runAsUser": 65532, "readOnlyRootFilesystem": true,
                   "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]},
                   "seccompProfile": {"type": "RuntimeDefault"}})
        );
        assert_eq!(
            env(&sidecar, "DROPGATE_NAMESPACE")["valueFrom"]["fieldRef"]["fieldPath"],
            "metadata.namespace"
        );
        assert_eq!(
            env(&sidecar, "DROPGATE_REDIS_URL")["valueFrom"]["secretKeyRef"],
            json!({"name": "dropgate-redis", "key": "url", "optional": false})
        );
        assert!(
            env(&sidecar, "DROPGATE_REDIS_URL").get("value").is_none(),
            "never inlined"
        );
        assert_eq!(
            env(&sidecar, "DROPGATE_DATABASE_URL")["value"],
            "sqlite:///var/lib/dropgate/ledger.db"
        );
        assert_eq!(env(&sidecar, "DROPGATE_LISTEN")["value"], "127.0.0.1:7070");
        assert_eq!(
            env(&sidecar, "DROPGATE_HEALTH_LISTEN")["value"],
            "0.0.0.0:7071"
        );
        let readiness = serde_json::to_value(&sidecar.readiness_probe).expect("json");
        assert_eq!(
            readiness["httpGet"],
            json!({"path": "/readyz", "port": "dropgate-health"}),
            "no host: the kubelet reaches the pod IP"
        );
        let volumes =
            serde_json::to_value(&pod.spec.as_ref().expect("spec").volumes).expect("json");
        assert_eq!(
            volumes[0],
            json!({"name": "dropgate-ledger", "emptyDir": {"sizeLimit": "1Gi"}})
        );
        assert_eq!(
            volumes[1],
            json!({"name": "dropgate-api-access", "projected": {"defaultMode": 420, "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}
            ]}}),
            "the sidecar's own token: the API server mounted the pod's before the sidecar was added"
        );
        assert_eq!(env(&sidecar, "DROPGATE_WATCH_DROPS")["value"], "true");
        let mounts = serde_json::to_value(&sidecar.volume_mounts).expect("json");
        assert_eq!(
            mounts,
            json!([
                {"name": "dropgate-ledger", "mountPath": "/var/lib/dropgate"},
                {"name": "dropgate-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}
            ])
        );
        assert_eq!(
            pod.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(INJECTED))
                .map(String::as_str),
            Some(env!("CARGO_PKG_VERSION"))
        );
        assert_eq!(
            pod.spec.as_ref().expect("spec").containers[0].name,
            "app",
            "the app is untouched"
        );
    }

    #[test]
    fn sidecars_speak_cluster_when_the_chart_says_their_redis_is_one() {
        let labelled = pod(json!({"dropgate.io/inject": "true"}), json!({}));
        let cluster_env = |settings: &Settings| match inject(&labelled, "shop", settings) {
            Ok(Decision::Inject(mutation)) => mutation
                .sidecar
                .env
                .into_iter()
                .flatten()
                .find(|e| e.name == "DROPGATE_REDIS_CLUSTER")
                .and_then(|e| e.value),
            other => panic!("not injected: {other:?}"),
        };
        assert_eq!(cluster_env(&settings()), None);
        let on_cluster = Cli::try_parse_from(["test", "--sidecar-redis-cluster"])
            .expect("valid settings")
            .settings;
        assert_eq!(cluster_env(&on_cluster).as_deref(), Some("true"));
    }

    #[test]
    fn traces_are_configured_only_when_the_chart_names_a_collector() {
        let labelled = pod(json!({"dropgate.io/inject": "true"}), json!({}));
        let names = |settings: &Settings| -> Vec<String> {
            match inject(&labelled, "shop", settings).expect("ok") {
                Decision::Inject(mutation) => mutation
                    .sidecar
                    .env
                    .into_iter()
                    .flatten()
                    .map(|e| e.name)
                    .collect(),
                Decision::Skip(why) => panic!("skipped: {}", why.as_str()),
            }
        };
        assert!(!names(&settings()).iter().any(|n| n.starts_with("OTEL_")));

        let traced = Cli::try_parse_from([
            "test",
            "--sidecar-otlp-endpoint",
            "http://$(HOST_IP):4318",
            "--sidecar-trace-sampler-arg",
            "0.25",
        ])
        .expect("valid settings")
        .settings;
        let mutation = match inject(&labelled, "shop", &traced).expect("ok") {
            Decision::Inject(mutation) => mutation,
            Decision::Skip(why) => panic!("skipped: {}", why.as_str()),
        };
        let sidecar = &mutation.sidecar;
        assert_eq!(
            env(sidecar, "OTEL_EXPORTER_OTLP_ENDPOINT")["value"],
            "http://$(HOST_IP):4318"
        );
        assert_eq!(
            env(sidecar, "HOST_IP")["valueFrom"]["fieldRef"]["fieldPath"],
            "status.hostIP"
        );
        assert_eq!(
            env(sidecar, "OTEL_SERVICE_NAME")["value"],
            "dropgate-sidecar"
        );
        assert_eq!(
            env(sidecar, "OTEL_TRACES_SAMPLER")["value"],
            "parentbased_traceidratio"
        );
        assert_eq!(env(sidecar, "OTEL_TRACES_SAMPLER_ARG")["value"], "0.25");
        // Kubernetes expands $(VAR) only from variables defined earlier in the list.
        let order = names(&traced);
        let at = |name: &str| order.iter().position(|n| n == name).expect(name);
        assert!(at("HOST_IP") < at("OTEL_EXPORTER_OTLP_ENDPOINT"));
        assert!(at("DROPGATE_NAMESPACE") < at("OTEL_RESOURCE_ATTRIBUTES"));
        assert!(at("DROPGATE_POD_NAME") < at("OTEL_RESOURCE_ATTRIBUTES"));

        for bad in [
            ["--sidecar-trace-sampler-arg", "1.5"],
            ["--sidecar-trace-sampler-arg", "most"],
            ["--sidecar-trace-sampler", "jaeger_remote"],
        ] {
            assert!(
                Cli::try_parse_from(["test", bad[0], bad[1]]).is_err(),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn pods_that_must_not_change_are_skipped() {
        let s = settings();
        let labelled = pod(json!({"dropgate.io/inject": "true"}), json!({}));
        let once = injected(&labelled, "shop");
        let table = [
            (once, "shop", Skip::AlreadyInjected),
            (
                // An old `inject -f` manifest's sidecar.
                serde_json::from_value(json!({
                    "metadata": {"name": "shop-1"},
                    "spec": {
                        "initContainers": [{"name": CONTAINER, "image": "dropgate:0.0.9"}],
                        "containers": [{"name": "app", "image": "shop:1"}]
                    }
                }))
                .expect("pod"),
                "shop",
                Skip::InjectedWithoutWatch,
            ),
            (
                pod(json!({"dropgate.io/inject": "false"}), json!({})),
                "shop",
                Skip::OptedOut,
            ),
            (labelled.clone(), "kube-system", Skip::ProtectedNamespace),
            (labelled, "dropgate-system", Skip::ProtectedNamespace),
        ];
        for (pod, namespace, why) in table {
            assert_eq!(
                inject(&pod, namespace, &s),
                Ok(Decision::Skip(why)),
                "{why:?}"
            );
        }
    }

    #[test]
    fn a_pod_of_an_opted_in_namespace_without_the_label_is_injected() {
        // The namespace selector decided to ask; the pod has no say unless "false".
        let decision = inject(&pod(json!({}), json!({})), "shop", &settings()).expect("ok");
        assert!(matches!(decision, Decision::Inject(_)));
    }

    #[test]
    fn the_charts_resources_and_ledger_size_reach_the_sidecar() {
        let chart = Cli::parse_from([
            "test",
            "--operator-namespace",
            "dropgate-system",
            "--sidecar-cpu",
            "100m",
            "--sidecar-memory",
            "96Mi",
            "--sidecar-memory-limit",
            "192Mi",
            "--sidecar-cpu-limit",
            "2",
            "--sidecar-ledger-size-limit",
            "256Mi",
            "--sidecar-ledger-retention",
            "7d",
        ])
        .settings;
        let per_pod = bare_pod(
            json!({"dropgate.io/inject": "true"}),
            json!({LEDGER: PER_POD}),
        );
        let Ok(Decision::Inject(mutation)) = inject(&per_pod, "shop", &chart) else {
            panic!("injected");
        };
        assert_eq!(
            serde_json::to_value(&mutation.sidecar.resources).expect("json"),
            json!({"requests": {"cpu": "100m", "memory": "96Mi"}, "limits": {"cpu": "2", "memory": "192Mi"}})
        );
        assert_eq!(
            serde_json::to_value(&mutation.ledger_volume).expect("json"),
            json!({"name": "dropgate-ledger", "emptyDir": {"sizeLimit": "256Mi"}})
        );
        assert_eq!(
            serde_json::to_value(&mutation.sidecar.env)
                .expect("json")
                .as_array()
                .map(|env| {
                    env.iter()
                        .any(|e| e == &json!({"name": "DROPGATE_LEDGER_RETENTION", "value": "7d"}))
                }),
            Some(true)
        );
        // A pod's own memory is its request and its limit.
        let own = bare_pod(
            json!({"dropgate.io/inject": "true"}),
            json!({LEDGER: PER_POD, MEMORY: "80Mi"}),
        );
        let Ok(Decision::Inject(mutation)) = inject(&own, "shop", &chart) else {
            panic!("injected");
        };
        assert_eq!(
            serde_json::to_value(&mutation.sidecar.resources).expect("json")["limits"]["memory"],
            "80Mi"
        );
        for (flag, value) in [
            ("--sidecar-memory-limit", "lots"),
            ("--sidecar-cpu-limit", "1Gi"),
            ("--sidecar-ledger-size-limit", "-1"),
            ("--sidecar-cpu", "100Mi"),
            ("--sidecar-ledger-retention", "10m"),
        ] {
            assert!(
                Cli::try_parse_from(["test", flag, value]).is_err(),
                "{flag} {value} was taken"
            );
        }
    }

    #[test]
    fn annotations_tune_the_sidecar() {
        let annotations = json!({
            IMAGE: "registry.example/dropgate:canary",
            CPU: "250m",
            MEMORY: "128Mi",
            PORT: "7171",
            DATABASE_SECRET: "shop-ledger",
            WAIT_REPLICAS: "1",
        });
        let pod = injected(&pod(json!({}), annotations), "shop");
        let sidecar = sidecar_of(&pod);
        assert_eq!(env(&sidecar, "DROPGATE_WAIT_REPLICAS")["value"], "1");
        assert_eq!(
            sidecar.image.as_deref(),
            Some("registry.example/dropgate:canary")
        );
        let resources = serde_json::to_value(&sidecar.resources).expect("json");
        assert_eq!(
            resources,
            json!({"requests": {"cpu": "250m", "memory": "128Mi"}, "limits": {"memory": "128Mi"}})
        );
        assert_eq!(env(&sidecar, "DROPGATE_LISTEN")["value"], "127.0.0.1:7171");
        assert_eq!(
            env(&sidecar, "DROPGATE_DATABASE_URL")["valueFrom"]["secretKeyRef"]["name"],
            "shop-ledger"
        );
        let volumes: Vec<&str> = pod
            .spec
            .as_ref()
            .and_then(|spec| spec.volumes.as_ref())
            .into_iter()
            .flatten()
            .map(|volume| volume.name.as_str())
            .collect();
        assert_eq!(
            volumes,
            ["dropgate-api-access"],
            "no SQLite volume with PostgreSQL"
        );
        let mounts: Vec<&str> = sidecar
            .volume_mounts
            .iter()
            .flatten()
            .map(|mount| mount.name.as_str())
            .collect();
        assert_eq!(mounts, ["dropgate-api-access"]);
    }

    /// The sidecar cannot wait for replicas on a Redis Cluster (it would refuse to
    /// start): the pod asking for it is refused where it is made; asking for none
    /// is fine, and a pod that does not ask gets no wait.
    #[test]
    fn waiting_for_replicas_on_a_redis_cluster_is_refused() {
        let mut on_cluster = settings();
        on_cluster.redis_cluster = true;
        let asking = pod(json!({}), json!({WAIT_REPLICAS: "1"}));
        let error = inject(&asking, "shop", &on_cluster).expect_err("refused");
        let Refusal::Annotation(refused) = &error else {
            panic!("{error}");
        };
        assert_eq!(refused.annotation, WAIT_REPLICAS);
        assert!(error.to_string().contains("Redis Cluster"), "{error}");

        let none = pod(json!({}), json!({WAIT_REPLICAS: "0"}));
        inject(&none, "shop", &on_cluster).expect("0 waits for nothing");
        let plain = injected(&pod(json!({}), json!({})), "shop");
        assert!(
            sidecar_of(&plain)
                .env
                .iter()
                .flatten()
                .all(|var| var.name != "DROPGATE_WAIT_REPLICAS")
        );
    }

    #[test]
    fn a_bad_annotation_is_refused_by_name() {
        let table = [
            (PORT, "http"),
            (PORT, "0"),
            (PORT, "70000"),
            (PORT, "7071"),
            (CPU, "lots"),
            (CPU, "100Mi"),
            (CPU, "-1"),
            (CPU, "100000"),
            (MEMORY, "1"),
            (IMAGE, "Registry.Example/DropGate:Canary"),
            (MEMORY, "64MB"),
            (MEMORY, ""),
            (IMAGE, "two words"),
            (IMAGE, ""),
            (DATABASE_SECRET, "Not_A_Name"),
            (WAIT_REPLICAS, "-1"),
            (WAIT_REPLICAS, "17"),
            (WAIT_REPLICAS, "one"),
        ];
        for (annotation, value) in table {
            let error = inject(
                &pod(json!({}), json!({annotation: value})),
                "shop",
                &settings(),
            )
            .expect_err(annotation);
            let Refusal::Annotation(refused) = &error else {
                panic!("{annotation}: {error}");
            };
            assert_eq!(
                (refused.annotation, refused.value.as_str()),
                (annotation, value)
            );
            assert!(
                error
                    .to_string()
                    .starts_with(&format!("annotation {annotation}: ")),
                "{error}"
            );
        }
    }

    #[test]
    fn the_patch_only_adds_and_keeps_what_the_api_types_do_not_know() {
        let raw = json!({
            "metadata": {"name": "shop-1", "labels": {"dropgate.io/inject": "true"},
                         "annotations": {LEDGER: PER_POD}},
            "spec": {
                "initContainers": [{"name": "migrate", "image": "m:1", "fieldFromTheFuture": {"x": 1}}],
                "volumes": [{"name": "data", "emptyDir": {}}],
                "containers": [{"name": "app", "image": "shop:1"}]
            }
        });
        let pod: Pod = serde_json::from_value(raw.clone()).expect("pod");
        let Decision::Inject(mutation) = inject(&pod, "shop", &settings()).expect("ok") else {
            panic!("skipped");
        };
        let patch = serde_json::to_value(mutation.patch(&raw)).expect("json");
        let ops: Vec<(&str, &str)> = patch
            .as_array()
            .expect("ops")
            .iter()
            .map(|op| {
                (
                    op["op"].as_str().unwrap_or(""),
                    op["path"].as_str().unwrap_or(""),
                )
            })
            .collect();
        assert_eq!(
            ops,
            [
                ("add", "/spec/initContainers/0"),
                ("add", "/spec/volumes/-"),
                ("add", "/spec/volumes/-"),
                ("add", "/metadata/annotations/dropgate.io~1injected")
            ]
        );
        let mut after = raw.clone();
        mutation.apply(&mut after).expect("applies");
        let init = &after["spec"]["initContainers"];
        assert_eq!(init[0]["name"], CONTAINER);
        assert_eq!(
            init[1], raw["spec"]["initContainers"][0],
            "untouched, unknown field and all"
        );
        assert_eq!(after["spec"]["volumes"][0], raw["spec"]["volumes"][0]);
        assert_eq!(after["spec"]["volumes"][1]["name"], "dropgate-ledger");
    }

    #[test]
    fn an_unknown_dropgate_annotation_is_a_typo_refused_by_name() {
        let error = inject(
            &pod(json!({}), json!({"dropgate.io/sidecar-image": "x:1"})),
            "shop",
            &settings(),
        )
        .expect_err("refused");
        assert!(
            error.to_string().contains("dropgate.io/sidecar-image"),
            "{error}"
        );
        let other = pod(
            json!({}),
            json!({"example.com/team": "shoes", INJECTED: "0.0.9"}),
        );
        assert!(
            inject(&other, "shop", &settings()).is_ok(),
            "other prefixes and our own mark pass"
        );
    }

    #[test]
    fn quantities_and_image_references() {
        assert_eq!(quantity("250m", false), Some(0.25));
        assert_eq!(quantity("64Mi", true), Some(64.0 * MI));
        for bad in ["", "m", "1.2.3", ".5", "5.", "1e3", "0"] {
            assert_eq!(
                (quantity(bad, false), quantity(bad, true)),
                (None, None),
                "{bad}"
            );
        }
        for good in [
            "dropgate:0.1.0",
            "registry.example.com/shop/dropgate:canary",
            "Registry.Example:5000/dropgate",
            "localhost/dropgate@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        ] {
            assert!(is_image_reference(good), "{good}");
        }
        for bad in [
            "",
            "two words",
            "Registry.Example/DropGate:Canary",
            "dropgate:",
            "dropgate@sha256:xyz",
            "/dropgate",
        ] {
            assert!(!is_image_reference(bad), "{bad}");
        }
    }

    #[test]
    fn a_pod_that_names_no_ledger_is_refused_unless_it_opts_into_a_per_pod_one() {
        let labelled = json!({"dropgate.io/inject": "true"});
        let error = inject(&bare_pod(labelled.clone(), json!({})), "shop", &settings())
            .expect_err("no ledger named");
        assert_eq!(error, Refusal::NoLedger);
        let message = error.to_string();
        for named in [DATABASE_SECRET, "sidecar.database.existingSecret", LEDGER] {
            assert!(message.contains(named), "{message}");
        }
        // The opt-in, a Secret of the pod's own, and the chart's default each do.
        let per_pod = bare_pod(labelled.clone(), json!({LEDGER: PER_POD}));
        assert!(matches!(
            inject(&per_pod, "shop", &settings()),
            Ok(Decision::Inject(_))
        ));
        let own = bare_pod(labelled.clone(), json!({DATABASE_SECRET: "shop-ledger"}));
        assert!(matches!(
            inject(&own, "shop", &settings()),
            Ok(Decision::Inject(_))
        ));
        let chart = Settings {
            database_secret: Some("dropgate-ledger".into()),
            ..settings()
        };
        let Ok(Decision::Inject(mutation)) = inject(&bare_pod(labelled, json!({})), "shop", &chart)
        else {
            panic!("the chart's ledger Secret names a ledger");
        };
        assert!(mutation.ledger_volume.is_none(), "no per-pod ledger then");
    }

    #[test]
    fn a_per_pod_ledger_and_a_ledger_secret_on_one_pod_are_refused() {
        let both = bare_pod(
            json!({"dropgate.io/inject": "true"}),
            json!({LEDGER: PER_POD, DATABASE_SECRET: "shop-ledger"}),
        );
        let error = inject(&both, "shop", &settings()).expect_err("contradiction");
        assert!(error.to_string().contains(LEDGER), "{error}");
        let other = bare_pod(json!({}), json!({LEDGER: "shared"}));
        let error = inject(&other, "shop", &settings()).expect_err("unknown ledger");
        assert!(
            error
                .to_string()
                .starts_with(&format!("annotation {LEDGER}: ")),
            "{error}"
        );
        // The pod's own per-pod choice stands over the chart's default Secret.
        let chart = Settings {
            database_secret: Some("dropgate-ledger".into()),
            ..settings()
        };
        let Ok(Decision::Inject(mutation)) = inject(
            &bare_pod(json!({}), json!({LEDGER: PER_POD})),
            "shop",
            &chart,
        ) else {
            panic!("injected");
        };
        assert!(mutation.ledger_volume.is_some());
    }

    #[test]
    fn a_host_network_pod_is_refused() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "node-agent", "labels": {"dropgate.io/inject": "true"},
                         "annotations": {LEDGER: PER_POD}},
            "spec": {"hostNetwork": true, "containers": [{"name": "app", "image": "agent:1"}]}
        }))
        .expect("pod");
        let error = inject(&pod, "shop", &settings()).expect_err("hostNetwork");
        assert_eq!(error, Refusal::HostNetwork);
        assert!(error.to_string().contains("hostNetwork"), "{error}");
    }
}
