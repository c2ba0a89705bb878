//! `dropgate-operator inject -f manifest.yaml`: the webhook's mutation applied to
//! the pods and pod templates of a multi-document manifest, for teams that commit
//! the injected manifest (GitOps), like `linkerd inject`.

use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize;
use serde_json::Value;

use super::{Decision, Settings, inject};

/// Where each kind keeps its pod template.
fn template_path(kind: &str) -> Option<&'static [&'static str]> {
    match kind {
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => {
            Some(&["spec", "template"])
        }
        "CronJob" => Some(&["spec", "jobTemplate", "spec", "template"]),
        _ => None,
    }
}

/// Injects every Pod and pod template in `text`; other documents pass unchanged.
/// Returns the manifest as YAML documents separated by `---`.
pub fn inject_manifest(text: &str, settings: &Settings) -> Result<String, String> {
    let mut out = Vec::new();
    for (index, document) in serde_norway::Deserializer::from_str(text).enumerate() {
        let mut value = Value::deserialize(document)
            .map_err(|e| format!("document {}: not YAML: {e}", index + 1))?;
        if value.is_null() {
            continue; // an empty document, as after a trailing `---`
        }
        let kind = value["kind"].as_str().unwrap_or_default().to_string();
        let name = value["metadata"]["name"]
            .as_str()
            .unwrap_or("(no name)")
            .to_string();
        let namespace = value["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string();
        let at = |e: String| format!("{kind} {name} (document {}): {e}", index + 1);
        let path = if kind == "Pod" {
            Some(&[][..])
        } else {
            template_path(&kind)
        };
        // How many pods the workload runs at once (a DaemonSet: one per node).
        let replicas = match kind.as_str() {
            "DaemonSet" => None,
            "Deployment" | "StatefulSet" | "ReplicaSet" => {
                Some(value["spec"]["replicas"].as_i64().unwrap_or(1))
            }
            _ => Some(1),
        };
        if let Some(pod_json) =
            path.and_then(|path| path.iter().try_fold(&mut value, |v, key| v.get_mut(*key)))
        {
            let pod: Pod = serde_json::from_value(pod_json.clone())
                .map_err(|e| at(format!("not a pod (template): {e}")))?;
            if let Decision::Inject(mutation) =
                inject(&pod, &namespace, settings).map_err(|e| at(e.to_string()))?
            {
                // Here the workload is known: a per-pod ledger serves one replica.
                if mutation.ledger_volume.is_some() && replicas.is_none_or(|n| n > 1) {
                    return Err(at(format!(
                        "{} pods with a per-pod ledger (dropgate.io/ledger: per-pod): a sale is recorded by one ledger, so only one of them could sell; give the pods a shared PostgreSQL ledger (dropgate.io/database-secret)",
                        replicas.map_or_else(|| "one per node".to_string(), |n| n.to_string())
                    )));
                }
                mutation.apply(pod_json).map_err(|e| at(e.to_string()))?;
            }
        }
        out.push(serde_norway::to_string(&value).map_err(|e| at(e.to_string()))?);
    }
    Ok(out.join("---\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        settings: Settings,
    }

    const MANIFEST: &str = r#"
apiVersion: apps/v1
kind: Deployment
metadata: {name: shop, namespace: shop}
spec:
  replicas: 3
  selector: {matchLabels: {app: shop}}
  template:
    metadata:
      labels: {app: shop, dropgate.io/inject: "true"}
      annotations: {dropgate.io/database-secret: shop-ledger}
    spec:
      containers: [{name: app, image: "shop:1"}]
---
apiVersion: v1
kind: Service
metadata: {name: shop, namespace: shop}
spec: {ports: [{port: 80}]}
---
apiVersion: batch/v1
kind: CronJob
metadata: {name: restock, namespace: shop}
spec:
  schedule: "0 * * * *"
  jobTemplate:
    spec:
      template:
        metadata: {labels: {dropgate.io/inject: "false"}}
        spec:
          restartPolicy: Never
          containers: [{name: job, image: "restock:1"}]
---
"#;

    #[test]
    fn templates_are_injected_and_everything_else_passes_through() {
        let settings = Cli::parse_from(["test"]).settings;
        let out = inject_manifest(MANIFEST, &settings).expect("injects");
        let docs: Vec<Value> = serde_norway::Deserializer::from_str(&out)
            .map(|d| Value::deserialize(d).expect("yaml"))
            .collect();
        assert_eq!(docs.len(), 3);
        let template = &docs[0]["spec"]["template"];
        assert_eq!(
            template["spec"]["initContainers"][0]["name"],
            "dropgate-sidecar"
        );
        assert!(template.get("apiVersion").is_none() && template.get("status").is_none());
        assert_eq!(template["metadata"]["labels"]["app"], "shop");
        assert_eq!(docs[0]["spec"]["replicas"], 3);
        assert_eq!(docs[1]["kind"], "Service");
        let job = &docs[2]["spec"]["jobTemplate"]["spec"]["template"]["spec"];
        assert!(job.get("initContainers").is_none(), "opted out");
        assert_eq!(
            inject_manifest(&out, &settings).expect("again"),
            out,
            "idempotent"
        );
    }

    #[test]
    fn a_bad_annotation_names_the_object() {
        let settings = Cli::parse_from(["test"]).settings;
        let bad = MANIFEST.replace(
            "annotations: {dropgate.io/database-secret: shop-ledger}",
            "annotations: {dropgate.io/database-secret: shop-ledger, dropgate.io/port: http}",
        );
        let error = inject_manifest(&bad, &settings).expect_err("refused");
        assert!(
            error.starts_with("Deployment shop (document 1): annotation dropgate.io/port"),
            "{error}"
        );
    }

    #[test]
    fn a_per_pod_ledger_is_refused_for_a_workload_of_several_replicas() {
        let settings = Cli::parse_from(["test"]).settings;
        let per_pod = MANIFEST.replace(
            "annotations: {dropgate.io/database-secret: shop-ledger}",
            "annotations: {dropgate.io/ledger: per-pod}",
        );
        let error = inject_manifest(&per_pod, &settings).expect_err("3 replicas, per pod");
        assert!(
            error.starts_with("Deployment shop (document 1): 3 pods with a per-pod ledger"),
            "{error}"
        );
        let one = per_pod.replace("replicas: 3", "replicas: 1");
        assert!(inject_manifest(&one, &settings).is_ok(), "one replica may");
        let daemons = one.replace("kind: Deployment", "kind: DaemonSet");
        let error = inject_manifest(&daemons, &settings).expect_err("one per node");
        assert!(error.contains("one per node"), "{error}");
    }
}
