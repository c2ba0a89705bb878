//! `dropgate-operator apply -f drop.yaml`: the controller's reconcile, run once
//! against Redis without Kubernetes.

use dropgate_api::InventoryDrop;
use k8s_openapi::jiff::Timestamp;

use crate::memorystore::Memorystore;
use crate::reconcile::{self, Reconciled};
use crate::{Error, Result, store};
use tracing::Instrument;

/// The YAML documents of a manifest file, each as its own text (empty documents
/// left out): `apply -f` reconciles each.
pub fn documents(text: &str) -> Result<Vec<String>> {
    use serde::Deserialize;
    let mut out = Vec::new();
    for (i, document) in serde_norway::Deserializer::from_str(text).enumerate() {
        let value = serde_norway::Value::deserialize(document)
            .map_err(|e| Error::InvalidManifest(format!("document {}: {e}", i + 1)))?;
        if value.is_null() {
            continue;
        }
        out.push(
            serde_norway::to_string(&value)
                .map_err(|e| Error::InvalidManifest(format!("document {}: {e}", i + 1)))?,
        );
    }
    if out.is_empty() {
        return Err(Error::InvalidManifest(
            "the manifest holds no document".into(),
        ));
    }
    Ok(out)
}

/// Reads one InventoryDrop manifest. Type errors name their path
/// (`spec.limitedQuantity: invalid type: ...`).
pub fn parse_manifest(text: &str) -> Result<InventoryDrop> {
    let value: serde_norway::Value =
        serde_norway::from_str(text).map_err(|e| Error::InvalidManifest(e.to_string()))?;
    let field = |name: &str| value.get(name).and_then(|v| v.as_str()).unwrap_or("");
    let (api_version, kind) = (field("apiVersion"), field("kind"));
    if api_version != "dropgate.io/v1alpha1" || kind != "InventoryDrop" {
        return Err(Error::InvalidManifest(format!(
            "expected apiVersion dropgate.io/v1alpha1 and kind InventoryDrop, found {api_version:?} {kind:?}"
        )));
    }
    let drop: InventoryDrop =
        serde_norway::from_str(text).map_err(|e| Error::InvalidManifest(e.to_string()))?;
    if let Ok(json) = serde_json::to_value(&value)
        && let unknown = dropgate_api::drop::unknown_spec_fields(&json)
        && !unknown.is_empty()
    {
        return Err(Error::InvalidManifest(format!(
            "unknown field(s) {}",
            unknown.join(", ")
        )));
    }
    reconcile::validate(&drop, reconcile::Origin::Manifest)?;
    Ok(drop)
}

/// Reconciles `manifest` into Redis. `redis_url` overrides `spec.redis.url`;
/// `memorystore` verifies drops that name an instance.
///
/// Returns the reconciled status even when the drop is not Ready (HA required and
/// missing): the resulting mode is published first, then the caller reports the
/// failure.
pub async fn apply(
    manifest: &str,
    redis_url: Option<&str>,
    memorystore: &Memorystore,
) -> Result<Reconciled> {
    let drop = parse_manifest(manifest)?;
    let span = reconcile::span(&drop);
    let applied = apply_parsed(&drop, redis_url, memorystore)
        .instrument(span.clone())
        .await;
    if applied.is_err() {
        span.record("otel.status_code", "ERROR");
    }
    applied
}

async fn apply_parsed(
    drop: &InventoryDrop,
    redis_url: Option<&str>,
    memorystore: &Memorystore,
) -> Result<Reconciled> {
    let url = match (redis_url, &drop.spec.redis.url) {
        (Some(url), _) => url.to_string(),
        (None, Some(url)) => url.clone(),
        (None, None) if drop.spec.redis.secret_ref.is_some() => {
            return Err(Error::SecretRefOutsideCluster);
        }
        (None, None) => return Err(Error::NoRedisUrl),
    };
    let mut conn = store::connect(&url, drop.spec.redis.cluster).await?;
    let report = reconcile::verify_ha(drop, &url, &mut conn, memorystore).await;
    // A one-shot run has no grace period to wait out: an unanswered check keeps
    // the mode already published and says the drop is not Ready.
    let (kept, unanswered) = if report.is_verified() {
        (None, None)
    } else {
        let published = store::published(&mut conn, &reconcile::keys_of(drop)).await?;
        (published.map(|c| c.mode), Some(report.message.clone()))
    };
    let mut done = reconcile::reconcile(
        drop,
        &mut conn,
        report,
        kept,
        None,
        // Nobody keeps a status to record claims in: they count at once.
        dropgate_api::keys::Claims::Immediate,
        Timestamp::now(),
    )
    .await?;
    if drop.spec.redis.require_high_availability
        && let Some(message) = unanswered
    {
        done.not_ready = Some(Error::HighAvailabilityMissing(format!(
            "could not check: {message}"
        )));
    }
    Ok(done)
}
