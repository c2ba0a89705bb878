package suite

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// sidecar_injected_by_webhook: the chart's MutatingWebhookConfiguration sends pod
// creations to an operator replica (a follower: every replica serves admission)
// over TLS with the chart's certificate, and the API server stores:
// a labelled pod with the native sidecar (passing Pod Security "restricted"), the
// same pod again unchanged, an unlabelled pod untouched, a pod with a bad
// annotation refused with its name, the namespace opt-in and pod opt-out, and the
// pods of a Deployment injected by `dropgate-operator inject -f` left as they are.
func sidecarInjectedByWebhook(t *testing.T, e *env) {
	e.startOperator(t)
	port := freePort(t)
	// The API server calls the replica at 127.0.0.1 (no pods run here); the chart
	// then issues its certificate for that address too.
	e.must(t, "helm", "upgrade", release, e.path("charts/dropgate"), "--namespace", operatorNS,
		"--reuse-values", "--set", fmt.Sprintf("webhook.url=https://127.0.0.1:%d/mutate", port))
	t.Cleanup(func() {
		_, _ = e.run("helm", "upgrade", release, e.path("charts/dropgate"), "--namespace", operatorNS,
			"--reuse-values", "--set", "webhook.url=")
	})
	certDir := e.webhookCertificate(t, release+"-webhook-tls")
	replica := e.startOperatorProcess(t, "webhook-replica", e.operatorSettings(t, map[string]string{
		"POD_NAME":                  "e2e-webhook-replica",
		"DROPGATE_WEBHOOK_LISTEN":   fmt.Sprintf("127.0.0.1:%d", port),
		"DROPGATE_WEBHOOK_CERT_DIR": certDir,
		"DROPGATE_SIDECAR_IMAGE":    "registry.example/dropgate:e2e",
	}), fmt.Sprintf("127.0.0.1:%d", freePort(t)))
	t.Cleanup(replica.stop)

	ns := "e2e-inject"
	e.ensureNamespace(t, ns)
	e.kubectl(t, "label", "--overwrite", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
	labelled := appPod(ns, "labelled", `dropgate.io/inject: "true"`, perPod)
	e.eventually(t, "the replica answers admission", func() (bool, string) {
		out, err := e.runIn(labelled, "kubectl", "apply", "--dry-run=server", "-o", "json", "-f", "-")
		return err == nil && strings.Contains(out, "dropgate-sidecar"), out
	})

	e.kubectlIn(t, labelled, "apply", "-f", "-")
	pod := e.pod(t, ns, "labelled")
	pod.hasSidecar(t, "registry.example/dropgate:e2e")
	// The container as stored, run as a kubelet would: it becomes ready on its
	// probe port and sells on the loopback port the app calls.
	e.kubectl(t, "-n", ns, "create", "secret", "generic", "dropgate-redis", "--from-literal=url="+e.redisURL)
	e.kubectlIn(t, dropManifest(t, e, ns, "injected-sale", 5), "apply", "-f", "-")
	e.waitField(t, ns, "inventorydrop/injected-sale", "{.status.mode}", "gate")
	running := e.runLikeKubelet(t, ns, pod)
	running.reserve(t, "order-1", "alice", 201, "gate")
	version := e.jsonpath(t, ns, "pod/labelled", "{.metadata.resourceVersion}")
	if out := e.kubectlIn(t, labelled, "apply", "-f", "-"); !strings.Contains(out, "unchanged") {
		t.Errorf("a second apply of the same pod: %q, want unchanged", out)
	}
	if again := e.jsonpath(t, ns, "pod/labelled", "{.metadata.resourceVersion}"); again != version {
		t.Errorf("a second apply changed the stored pod (resourceVersion %s -> %s)", version, again)
	}

	e.kubectlIn(t, appPod(ns, "plain", "", ""), "apply", "-f", "-")
	e.pod(t, ns, "plain").hasNoSidecar(t)

	_, err := e.runIn(appPod(ns, "bad", `dropgate.io/inject: "true"`, perPod+`, dropgate.io/port: "http"`), "kubectl", "apply", "-f", "-")
	if err == nil || !strings.Contains(err.Error(), "annotation dropgate.io/port") {
		t.Errorf("a pod with a bad annotation: %v; want refused naming dropgate.io/port", err)
	}
	if _, err := e.run("kubectl", "-n", ns, "get", "pod", "bad"); err == nil {
		t.Errorf("the pod with a bad annotation was stored")
	}
	// A pod that names no ledger is refused where it is made, saying how to name one.
	_, err = e.runIn(appPod(ns, "no-ledger", `dropgate.io/inject: "true"`, ""), "kubectl", "apply", "-f", "-")
	if err == nil || !strings.Contains(err.Error(), "dropgate.io/ledger: per-pod") || !strings.Contains(err.Error(), "dropgate.io/database-secret") {
		t.Errorf("a pod that names no ledger: %v; want refused naming dropgate.io/database-secret and dropgate.io/ledger", err)
	}

	// A hostNetwork pod is refused: the sidecar's API would sit on the node's loopback.
	hostNet := strings.Replace(appPod(ns, "host-net", `dropgate.io/inject: "true"`, perPod), "spec:\n", "spec:\n  hostNetwork: true\n", 1)
	_, err = e.runIn(hostNet, "kubectl", "apply", "-f", "-")
	// (Said by the webhook, which runs before Pod Security would refuse it too.)
	if err == nil || !strings.Contains(err.Error(), "dropgate is not injected into hostNetwork pods") {
		t.Errorf("a hostNetwork pod: %v; want refused by the webhook, naming hostNetwork", err)
	}
	if _, err := e.run("kubectl", "-n", ns, "get", "pod", "host-net"); err == nil {
		t.Errorf("the hostNetwork pod was stored")
	}

	// A namespace that opts in: every pod but those labelled "false".
	optIn := "e2e-inject-ns"
	e.ensureNamespace(t, optIn)
	e.kubectl(t, "label", "--overwrite", "namespace", optIn, "dropgate.io/inject=enabled")
	e.kubectlIn(t, appPod(optIn, "by-namespace", "", perPod), "apply", "-f", "-")
	e.pod(t, optIn, "by-namespace").hasSidecar(t, "registry.example/dropgate:e2e")
	e.kubectlIn(t, appPod(optIn, "opted-out", `dropgate.io/inject: "false"`, ""), "apply", "-f", "-")
	e.pod(t, optIn, "opted-out").hasNoSidecar(t)

	// GitOps: a Deployment injected by `inject -f`; kube-controller-manager creates
	// its pods, which pass the webhook with exactly one sidecar.
	injected := e.must(t, filepath.Join(e.bin, "dropgate-operator"), "inject", "-f", e.writeFile(t, "shop.yaml", shopDeployment(ns)))
	e.kubectlIn(t, injected, "apply", "-f", "-")
	e.eventually(t, "the Deployment's pod is stored", func() (bool, string) {
		out, err := e.run("kubectl", "-n", ns, "get", "pods", "-l", "app=gitops-shop", "-o", "name")
		return err == nil && strings.TrimSpace(out) != "", out
	})
	name := strings.TrimPrefix(strings.Fields(e.kubectl(t, "-n", ns, "get", "pods", "-l", "app=gitops-shop", "-o", "name"))[0], "pod/")
	e.pod(t, ns, name).hasSidecar(t, "dropgate:e2e-gitops")
}

// perPod is the annotation of a pod that keeps a per-pod SQLite ledger (a workload
// of one replica): a pod injected without a ledger Secret must say so.
const perPod = `dropgate.io/ledger: per-pod`

// appPod is a pod that passes Pod Security "restricted", with extra labels and
// annotations (YAML map entries, or "").
func appPod(ns, name, label, annotation string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: %s
  namespace: %s
  labels: {app: shop, %s}
  annotations: {%s}
spec:
  securityContext: {runAsNonRoot: true, runAsUser: 1000, seccompProfile: {type: RuntimeDefault}}
  containers:
    - name: app
      image: shop:1
      securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
`, name, ns, label, annotation)
}

func shopDeployment(ns string) string {
	return fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata: {name: shop, namespace: %s}
spec:
  replicas: 1
  selector: {matchLabels: {app: gitops-shop}}
  template:
    metadata:
      labels: {app: gitops-shop, dropgate.io/inject: "true"}
      annotations: {dropgate.io/image: "dropgate:e2e-gitops", dropgate.io/ledger: per-pod}
    spec:
      securityContext: {runAsNonRoot: true, runAsUser: 1000, seccompProfile: {type: RuntimeDefault}}
      containers:
        - name: app
          image: shop:1
          securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
`, ns)
}

// storedPod is a pod as the API server stored it.
type storedPod struct {
	name     string
	Metadata struct {
		Annotations map[string]string `json:"annotations"`
	} `json:"metadata"`
	Spec struct {
		InitContainers     []storedContainer `json:"initContainers"`
		ServiceAccountName string            `json:"serviceAccountName"`
	} `json:"spec"`
}

type storedContainer struct {
	Name           string   `json:"name"`
	Image          string   `json:"image"`
	Command        []string `json:"command"`
	RestartPolicy  string   `json:"restartPolicy"`
	ReadinessProbe struct {
		HTTPGet struct {
			Path string `json:"path"`
		} `json:"httpGet"`
	} `json:"readinessProbe"`
	Env []struct {
		Name      string          `json:"name"`
		Value     string          `json:"value"`
		ValueFrom json.RawMessage `json:"valueFrom"`
	} `json:"env"`
	VolumeMounts []struct {
		Name string `json:"name"`
	} `json:"volumeMounts"`
}

// runLikeKubelet starts the pod's dropgate-sidecar container as a process with the
// environment a kubelet would give it: fieldRef and secretKeyRef resolved, the
// emptyDir at a folder of this run, the sidecar's service-account token volume as a
// kubeconfig holding a token of the pod's service account (so the chart's RBAC is
// what it may do), and the two ports moved to free ones (every
// "pod" here shares the host's loopback). It returns once the readiness probe
// passes.
func (e *env) runLikeKubelet(t *testing.T, ns string, pod storedPod) *sidecar {
	t.Helper()
	c := pod.Spec.InitContainers[0]
	if len(c.Command) != 1 || c.Command[0] != "dropgate-sidecar" {
		t.Fatalf("sidecar command %v, want [dropgate-sidecar]", c.Command)
	}
	apiPort, healthPort := freePort(t), freePort(t)
	emptyDir := filepath.Join(e.work, "kubelet-"+strings.ReplaceAll(pod.name, "/", "-"))
	if err := os.MkdirAll(emptyDir, 0o700); err != nil {
		t.Fatal(err)
	}
	var vars []string
	for _, v := range c.Env {
		var from struct {
			FieldRef     *struct{ FieldPath string } `json:"fieldRef"`
			SecretKeyRef *struct{ Name, Key string } `json:"secretKeyRef"`
		}
		value := v.Value
		if len(v.ValueFrom) > 0 {
			if err := json.Unmarshal(v.ValueFrom, &from); err != nil {
				t.Fatal(err)
			}
		}
		switch {
		case from.FieldRef != nil && from.FieldRef.FieldPath == "metadata.namespace":
			value = ns
		case from.SecretKeyRef != nil:
			encoded := e.kubectl(t, "-n", ns, "get", "secret", from.SecretKeyRef.Name,
				"-o", "jsonpath={.data."+strings.ReplaceAll(from.SecretKeyRef.Key, ".", `\.`)+"}")
			decoded, err := base64.StdEncoding.DecodeString(encoded)
			if err != nil {
				t.Fatal(err)
			}
			value = string(decoded)
		case len(v.ValueFrom) > 0:
			t.Fatalf("env %s: a source this emulation does not know: %s", v.Name, v.ValueFrom)
		}
		value = strings.ReplaceAll(value, "/var/lib/dropgate", emptyDir)
		value = strings.ReplaceAll(value, "127.0.0.1:7070", fmt.Sprintf("127.0.0.1:%d", apiPort))
		value = strings.ReplaceAll(value, "0.0.0.0:7071", fmt.Sprintf("127.0.0.1:%d", healthPort))
		vars = append(vars, v.Name+"="+value)
	}
	// The token the webhook mounts for the sidecar: one of the pod's service account.
	for _, m := range c.VolumeMounts {
		if m.Name == "dropgate-api-access" {
			sa := pod.Spec.ServiceAccountName
			if sa == "" {
				sa = "default"
			}
			vars = append(vars, "KUBECONFIG="+e.tokenKubeconfig(t, ns, sa))
		}
	}
	p := e.start(t, "injected-sidecar", filepath.Join(e.bin, "dropgate-sidecar"), nil, append(vars, "RUST_LOG=info"))
	t.Cleanup(p.stop)
	probe := fmt.Sprintf("http://127.0.0.1:%d%s", healthPort, c.ReadinessProbe.HTTPGet.Path)
	e.eventually(t, "the injected sidecar's readiness probe passes", func() (bool, string) {
		if p.exited() {
			t.Fatalf("the injected sidecar exited: %v", p.err)
		}
		a, err := call("GET", probe, nil)
		if err != nil {
			return false, err.Error()
		}
		return a.status == 200, a.String()
	})
	return &sidecar{name: "injected-sidecar", proc: p, base: fmt.Sprintf("http://127.0.0.1:%d/v1/drops/injected-sale", apiPort)}
}

func (e *env) pod(t *testing.T, ns, name string) storedPod {
	t.Helper()
	var pod storedPod
	if err := json.Unmarshal([]byte(e.kubectl(t, "-n", ns, "get", "pod", name, "-o", "json")), &pod); err != nil {
		t.Fatal(err)
	}
	pod.name = ns + "/" + name
	return pod
}

// hasSidecar: exactly one native dropgate-sidecar, first, with its Redis URL from
// a Secret, and the pod annotated with the injecting version.
func (p storedPod) hasSidecar(t *testing.T, image string) {
	t.Helper()
	count := 0
	for _, c := range p.Spec.InitContainers {
		if c.Name == "dropgate-sidecar" {
			count++
		}
	}
	if count != 1 || p.Spec.InitContainers[0].Name != "dropgate-sidecar" {
		t.Fatalf("pod %s: %d dropgate-sidecar init containers (want exactly one, first)", p.name, count)
	}
	sidecar := p.Spec.InitContainers[0]
	if sidecar.RestartPolicy != "Always" || sidecar.Image != image {
		t.Errorf("pod %s: sidecar restartPolicy %q image %q, want Always %q", p.name, sidecar.RestartPolicy, sidecar.Image, image)
	}
	for _, env := range sidecar.Env {
		if env.Name == "DROPGATE_REDIS_URL" && (env.Value != "" || !strings.Contains(string(env.ValueFrom), "secretKeyRef")) {
			t.Errorf("pod %s: DROPGATE_REDIS_URL must come from a Secret: %s", p.name, env.ValueFrom)
		}
	}
	if p.Metadata.Annotations["dropgate.io/injected"] == "" {
		t.Errorf("pod %s: no dropgate.io/injected annotation", p.name)
	}
}

func (p storedPod) hasNoSidecar(t *testing.T) {
	t.Helper()
	if len(p.Spec.InitContainers) != 0 || p.Metadata.Annotations["dropgate.io/injected"] != "" {
		t.Errorf("pod %s was injected", p.name)
	}
}

// webhookCertificate writes the serving certificate the chart keeps in secret to
// a folder, as a mounted Secret would be; returns the folder.
func (e *env) webhookCertificate(t *testing.T, secret string) string {
	t.Helper()
	dir := filepath.Join(e.work, "webhook-tls")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"tls.crt", "tls.key"} {
		encoded := e.kubectl(t, "-n", operatorNS, "get", "secret", secret,
			"-o", "jsonpath={.data."+strings.ReplaceAll(key, ".", `\.`)+"}")
		decoded, err := base64.StdEncoding.DecodeString(encoded)
		if err != nil {
			t.Fatalf("secret %s key %s: %v", secret, key, err)
		}
		if err := os.WriteFile(filepath.Join(dir, key), decoded, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func (e *env) writeFile(t *testing.T, name, content string) string {
	t.Helper()
	path := filepath.Join(e.work, name)
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
