"""Checks rendered manifests of charts/dropgate; run by scripts/check-chart.

  check-chart.py validate K8S_VERSION RELEASE NAMESPACE RENDERED.yaml [--secret-access cluster|none]
      every manifest strictly against the Kubernetes K8S_VERSION schemas
      (kubernetes-validate), CRDs it cannot know skipped by kind; no duplicate keys
      anywhere (a label set twice); the release's labels on every object and in
      every selector; the CRD equal to crds/inventorydrop.yaml with the keep policy;
      the webhook configuration as the contract says; the operator's Secret access.
  check-chart.py disjoint RENDERED.yaml...
      renders of several releases: no two create the same object.
  check-chart.py described SCHEMA.json
      every property of the values schema (every entry of a "properties" map, at
      any depth, definitions and array items included) has a non-empty
      "description"; lists the JSON Pointer of each that has none.

Prints one line per finding and exits 1 when any check failed.
"""

import json
import sys

import yaml
import kubernetes_validate
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

# Kinds whose schema kubernetes-validate cannot have (third-party CRDs): skipped by
# name, so that any other unknown kind is a failure rather than a silent pass.
SKIPPED_KINDS = {
    ("cert-manager.io/v1", "Issuer"),
    ("cert-manager.io/v1", "Certificate"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}

CLUSTER_SCOPED = {
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "Namespace",
    "PriorityClass",
}


class StrictLoader(yaml.SafeLoader):
    """A YAML loader that refuses a mapping with a key twice (YAML parsers, the API
    server's included, would silently keep one of them)."""


def _mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)

failures = 0


def fail(msg):
    global failures
    failures += 1
    print(f"  FAIL {msg}")


def load(path):
    with open(path) as f:
        return [d for d in yaml.load_all(f, Loader=StrictLoader) if d]


def name_of(doc):
    meta = doc.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{doc.get('kind')}/{(ns + '/') if ns else ''}{meta.get('name')}"


def strip_release_metadata(crd):
    crd = yaml.safe_load(yaml.safe_dump(crd))
    crd["metadata"].pop("labels", None)
    crd["metadata"].pop("annotations", None)
    return crd


def secret_reader(doc):
    """The operator's Role (or RoleBinding) for the Secrets of one namespace."""
    return doc.get("kind") in ("Role", "RoleBinding") and \
        str((doc.get("metadata") or {}).get("name", "")).endswith("operator-secrets")


def validate(version, release, namespace, path, secret_access):
    docs = load(path)
    kinds = {}
    for doc in docs:
        kinds.setdefault(doc.get("kind"), []).append(doc)
        what = name_of(doc)
        key = (doc.get("apiVersion"), doc.get("kind"))
        if key in SKIPPED_KINDS:
            print(f"  skip {what}: no schema for {key[0]} {key[1]} (a third-party CRD)")
        else:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except ValidationError as e:
                where = ".".join(str(p) for p in e.path)
                fail(f"{what}: Kubernetes {version} schema: {where}: {e.message}")
            except SchemaNotFoundError as e:
                fail(f"{what}: {e.message}")

        meta = doc.get("metadata") or {}
        labels = meta.get("labels") or {}
        for label, want in (("app.kubernetes.io/instance", release),
                            ("app.kubernetes.io/managed-by", "Helm")):
            if labels.get(label) != want:
                fail(f"{what}: label {label} is {labels.get(label)!r}, want {want!r}")
        if not str(labels.get("helm.sh/chart", "")).startswith("dropgate-"):
            fail(f"{what}: no helm.sh/chart label")
        if doc.get("kind") in CLUSTER_SCOPED:
            if "namespace" in meta:
                fail(f"{what}: a cluster-scoped object with a namespace")
        elif meta.get("namespace") != namespace and not secret_reader(doc):
            fail(f"{what}: namespace {meta.get('namespace')!r}, want the release's {namespace!r}")
        name = str(meta.get("name", ""))
        limit = 63 if doc.get("kind") in ("Service", "Deployment") else 253
        if not name or len(name) > limit:
            fail(f"{what}: name longer than {limit} characters")
        selector = (doc.get("spec") or {}).get("selector")
        if doc.get("kind") in ("Deployment", "PodDisruptionBudget", "ServiceMonitor"):
            selector = (selector or {}).get("matchLabels")
        if doc.get("kind") in ("Deployment", "PodDisruptionBudget", "ServiceMonitor", "Service"):
            if (selector or {}).get("app.kubernetes.io/instance") != release:
                fail(f"{what}: its selector lacks app.kubernetes.io/instance={release}")

    def one(kind):
        found = kinds.get(kind, [])
        if len(found) != 1:
            fail(f"{len(found)} {kind} objects, want 1")
            return None
        return found[0]

    deployment = one("Deployment")
    if deployment:
        pod = deployment["spec"]["template"]
        if pod["metadata"]["labels"].get("app.kubernetes.io/instance") != release:
            fail("the operator's pod template lacks the instance label")
        spec = pod["spec"]
        if (spec.get("securityContext") or {}).get("seccompProfile", {}).get("type") != "RuntimeDefault":
            fail("the operator's pod has no seccompProfile RuntimeDefault")
        env = {e["name"]: e for e in spec["containers"][0].get("env", [])}
        for var in ("POD_NAME", "POD_NAMESPACE", "RUST_LOG", "DROPGATE_LEASE_NAME", "DROPGATE_HA_GRACE_SECONDS"):
            if var not in env:
                fail(f"the operator has no {var}")
        url = env.get("DROPGATE_REDIS_URL", {})
        if "valueFrom" in url and "secretKeyRef" not in url["valueFrom"]:
            fail("DROPGATE_REDIS_URL comes from something other than a Secret")

    webhook_config = kinds.get("MutatingWebhookConfiguration", [None])[0]
    if webhook_config:
        names = [w["name"] for w in webhook_config["webhooks"]]
        if names != ["pods.inject.dropgate.io", "namespaces.inject.dropgate.io"]:
            fail(f"webhooks {names}")
        for w in webhook_config["webhooks"]:
            client = w["clientConfig"]
            if "service" in client and client["service"].get("path") != "/mutate":
                fail(f"{w['name']}: path {client['service'].get('path')!r}, want /mutate")
            if not client.get("caBundle") and "cert-manager.io/inject-ca-from" not in (
                    webhook_config["metadata"].get("annotations") or {}):
                fail(f"{w['name']}: neither a caBundle nor cert-manager's CA injection")
            if w.get("sideEffects") != "None" or w.get("admissionReviewVersions") != ["v1"]:
                fail(f"{w['name']}: sideEffects/admissionReviewVersions")
            if w.get("reinvocationPolicy") != "IfNeeded":
                fail(f"{w['name']}: reinvocationPolicy {w.get('reinvocationPolicy')!r}")
            excluded = [e for e in w["namespaceSelector"]["matchExpressions"]
                        if e["key"] == "kubernetes.io/metadata.name"]
            if not excluded or excluded[0]["operator"] != "NotIn" or \
                    set(excluded[0]["values"]) != {"kube-system", namespace}:
                fail(f"{w['name']}: does not exclude kube-system and {namespace}")
            if w["rules"] != [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                               "resources": ["pods"], "scope": "Namespaced"}]:
                fail(f"{w['name']}: rules {w['rules']}")

    crds = kinds.get("CustomResourceDefinition", [])
    if crds:
        with open("crds/inventorydrop.yaml") as f:
            generated = yaml.load(f, Loader=StrictLoader)
        if strip_release_metadata(crds[0]) != generated:
            fail("the rendered CRD differs from crds/inventorydrop.yaml (beyond labels and annotations)")
        if (crds[0]["metadata"].get("annotations") or {}).get("helm.sh/resource-policy") != "keep":
            fail("the CRD lacks helm.sh/resource-policy: keep")

    # The aggregated roles for app teams grant InventoryDrops only; the
    # operator's is the one ClusterRole left.
    aggregated = [r for r in kinds.get("ClusterRole", [])
                  if any(k.startswith("rbac.authorization.k8s.io/aggregate-to-")
                         for k in (r["metadata"].get("labels") or {}))]
    for role in aggregated:
        granted = {res for rule in role["rules"] for res in rule.get("resources", [])}
        if not granted <= {"inventorydrops", "inventorydrops/status"}:
            fail(f"the aggregated ClusterRole {role['metadata']['name']} grants {sorted(granted)}")
    if len(aggregated) != 2:
        fail(f"{len(aggregated)} aggregated ClusterRoles, want 2 (edit and view)")
    kinds["ClusterRole"] = [r for r in kinds.get("ClusterRole", []) if r not in aggregated]

    # The sidecars' role reads InventoryDrops (their watch), nothing else.
    sidecar_roles = [r for r in kinds.get("ClusterRole", [])
                     if (r["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "sidecar"]
    for role in sidecar_roles:
        if role.get("rules") != [{"apiGroups": ["dropgate.io"], "resources": ["inventorydrops"],
                                  "verbs": ["get", "list", "watch"]}]:
            fail(f"the sidecars' ClusterRole {role['metadata']['name']} grants {role.get('rules')}")
    if len(sidecar_roles) != 1:
        fail(f"{len(sidecar_roles)} ClusterRoles for the sidecars, want 1")
    kinds["ClusterRole"] = [r for r in kinds.get("ClusterRole", []) if r not in sidecar_roles]

    if secret_access:
        access, _, listed = secret_access.partition(":")
        role = one("ClusterRole")
        if role:
            secrets = [r for r in role["rules"] if "secrets" in r.get("resources", [])]
            if access in ("none", "namespaces") and secrets:
                fail(f"operator.secretAccess={access}, yet the ClusterRole grants {secrets}")
            if access == "cluster" and [r["verbs"] for r in secrets] != [["get"]]:
                fail(f"operator.secretAccess=cluster: the ClusterRole grants {secrets}, want get only")
        # secretAccess=namespaces: a Role granting get on Secrets, and its binding,
        # in exactly the namespaces listed (none for the other settings).
        want = sorted(n for n in listed.split(",") if n)
        readers = [d for d in docs if secret_reader(d)]
        for kind in ("Role", "RoleBinding"):
            found = sorted(d["metadata"]["namespace"] for d in readers if d["kind"] == kind)
            if found != want:
                fail(f"operator.secretAccess={secret_access}: a Secret-reading {kind} in {found}, want {want}")
        for r in readers:
            if r["kind"] == "Role" and r.get("rules") != [
                    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]:
                fail(f"{name_of(r)}: grants {r.get('rules')}, want get on Secrets only")

    print(f"  {len(docs)} manifests checked against Kubernetes {version}")


def disjoint(paths):
    seen = {}
    for path in paths:
        for doc in load(path):
            meta = doc.get("metadata") or {}
            key = (doc.get("kind"), meta.get("namespace"), meta.get("name"))
            if key in seen:
                fail(f"{name_of(doc)} is in the renders {seen[key]} and {path}")
            seen[key] = path
    print(f"  {len(seen)} objects of {len(paths)} releases, none shared")


# JSON Schema keywords whose value is a map of names to schemas, a schema, or a
# list of schemas: where described() looks for nested "properties".
SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependencies",
               "dependentSchemas")
SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems",
              "unevaluatedProperties", "propertyNames", "contains", "not", "if", "then", "else")
SCHEMA_LIST = ("items", "prefixItems", "anyOf", "allOf", "oneOf")


def described(path):
    """Every property in the schema at path has a non-empty description."""
    with open(path, encoding="utf-8") as f:
        schema = json.load(f)
    count = missing = 0

    def walk(node, pointer):
        nonlocal count, missing
        if not isinstance(node, dict):
            return
        for keyword in SCHEMA_MAPS:
            members = node.get(keyword)
            if not isinstance(members, dict):
                continue
            for name, sub in members.items():
                where = f"{pointer}/{keyword}/" + name.replace("~", "~0").replace("/", "~1")
                if keyword == "properties":
                    count += 1
                    desc = sub.get("description") if isinstance(sub, dict) else None
                    if not isinstance(desc, str) or not desc.strip():
                        missing += 1
                        fail(f"{where}: no description")
                walk(sub, where)
        for keyword in SCHEMA_ONE:
            if isinstance(node.get(keyword), dict):
                walk(node[keyword], f"{pointer}/{keyword}")
        for keyword in SCHEMA_LIST:
            if isinstance(node.get(keyword), list):
                for i, sub in enumerate(node[keyword]):
                    walk(sub, f"{pointer}/{keyword}/{i}")

    walk(schema, "")
    if count == 0:
        fail(f"{path}: no properties at all")
        return
    print(f"  {count - missing} of {count} properties in {path} have a description")


def main(argv):
    if argv[:1] == ["validate"] and len(argv) in (5, 7):
        secret_access = argv[6] if len(argv) == 7 and argv[5] == "--secret-access" else None
        try:
            validate(argv[1], argv[2], argv[3], argv[4], secret_access)
        except yaml.YAMLError as e:
            fail(f"{argv[4]}: {e}")
    elif argv[:1] == ["disjoint"] and len(argv) > 2:
        disjoint(argv[1:])
    elif argv[:1] == ["described"] and len(argv) == 2:
        try:
            described(argv[1])
        except (OSError, ValueError) as e:
            fail(f"{argv[1]}: {e}")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
