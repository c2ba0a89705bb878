package suite

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

const (
	shopNS   = "shop" // examples/drop.yaml's namespace
	dropName = "sneaker-0412"
	dropObj  = "inventorydrop/" + dropName
)

// helm_install_real_api: the chart installs into a real API server (its objects
// pass validation and admission, its Pods Pod Security "restricted"; they are
// stored, nothing runs them), the CRD is
// Established, and every example passes a server-side dry run.
func helmInstallRealAPI(t *testing.T, e *env) {
	e.must(t, "helm", "lint", e.path("charts/dropgate"))
	e.installChart(t)

	var status struct {
		Info struct {
			Status string `json:"status"`
		} `json:"info"`
	}
	out := e.must(t, "helm", "status", release, "--namespace", operatorNS, "-o", "json")
	if err := json.Unmarshal([]byte(out), &status); err != nil {
		t.Fatalf("helm status: %v: %s", err, out)
	}
	if status.Info.Status != "deployed" {
		t.Fatalf("helm status: release is %q, want deployed", status.Info.Status)
	}

	e.kubectl(t, "wait", "--for=condition=Established", "crd/inventorydrops.dropgate.io", "--timeout=120s")
	columns := e.kubectl(t, "get", "crd", "inventorydrops.dropgate.io",
		"-o", `jsonpath={range .spec.versions[*].additionalPrinterColumns[*]}{.name}{" "}{end}`)
	for _, want := range []string{"SKU", "Limit", "Remaining", "Reserved", "Mode", "Phase", "Ready", "Age"} {
		if !containsFold(strings.Fields(columns), want) {
			t.Errorf("the CRD has no %s printer column (has %q)", want, columns)
		}
	}

	// The Deployment is stored, and (with kube-controller-manager) its ReplicaSet's
	// Pods too: they pass admission, Pod Security "restricted" included, even
	// though no kubelet runs them.
	replicas := e.jsonpath(t, operatorNS, "deployment/dropgate-operator", "{.spec.replicas}")
	if n, _ := strconv.Atoi(replicas); n > 0 {
		e.eventually(t, replicas+" operator Pods stored", func() (bool, string) {
			out, err := e.run("kubectl", "-n", operatorNS, "get", "pods",
				"-l", "app.kubernetes.io/name=dropgate,app.kubernetes.io/component=operator", "-o", "name")
			if err != nil {
				return false, err.Error()
			}
			why, _ := e.run("kubectl", "-n", operatorNS, "get", "events", "--field-selector", "reason=FailedCreate",
				"-o", "jsonpath={.items[-1:].message}")
			return len(strings.Fields(out)) == n, fmt.Sprintf("pods: %q; last FailedCreate: %q", out, why)
		})
	}
	sa := e.jsonpath(t, operatorNS, "deployment/dropgate-operator", "{.spec.template.spec.serviceAccountName}")
	e.kubectl(t, "-n", operatorNS, "get", "serviceaccount", sa)

	// Every example passes the API server's validation (schema, admission).
	e.ensureNamespace(t, shopNS)
	_, existed := e.run("kubectl", "-n", shopNS, "get", dropObj)
	out = e.kubectl(t, "apply", "--dry-run=server", "-f", e.path("examples"))
	if !strings.Contains(out, "server dry run") {
		t.Fatalf("kubectl apply --dry-run=server -f examples/: %s", out)
	}
	if _, err := e.run("kubectl", "-n", shopNS, "get", dropObj); existed != nil && err == nil {
		t.Fatalf("a server-side dry run created %s", dropObj)
	}
}

// operator_rbac_is_enough: the operator runs with a token of the chart's
// ServiceAccount, so what the chart grants is all that it has; with that, a drop
// reconciles to Ready, and it may not read Secrets beyond the chart's grant.
func operatorRBACIsEnough(t *testing.T, e *env) {
	e.startOperator(t)
	as := func(args ...string) (string, error) {
		return e.run("kubectl", append([]string{"--kubeconfig", e.saConfig}, args...)...)
	}
	who, err := as("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
	if err != nil {
		t.Fatal(err)
	}
	if want := "system:serviceaccount:" + operatorNS + ":" + operatorSA; who != want {
		t.Fatalf("the operator's kubeconfig is %q, want %q", who, want)
	}

	ns := "e2e-rbac"
	e.ensureNamespace(t, ns)
	manifest := dropManifest(t, e, ns, "rbac-drop", 7)
	e.kubectlIn(t, manifest, "apply", "-f", "-")
	e.kubectl(t, "-n", ns, "wait", "--for=condition=Ready", "inventorydrop/rbac-drop", "--timeout=120s")
	e.waitField(t, ns, "inventorydrop/rbac-drop", "{.status.remaining}", "7")

	// What the chart grants: get (not list or watch) of Secrets, for
	// spec.redis.secretRef, in the namespaces of operator.secretNamespaces only;
	// nothing that writes them, and no other workload access.
	canI := func(want string, args ...string) {
		t.Helper()
		out, _ := as(append([]string{"auth", "can-i"}, args...)...) // exit 1 means "no"
		if got := strings.TrimSpace(out); got != want {
			t.Errorf("kubectl auth can-i %s as the operator: %q, want %q", strings.Join(args, " "), got, want)
		}
	}
	canI("yes", "get", "secrets", "-n", secretsNS)
	for _, elsewhere := range []string{ns, "kube-system", "default", operatorNS} {
		canI("no", "get", "secrets", "-n", elsewhere)
	}
	canI("no", "get", "secrets", "--all-namespaces")
	for _, verb := range []string{"list", "watch", "create", "update", "patch", "delete"} {
		canI("no", verb, "secrets", "-n", secretsNS)
		canI("no", verb, "secrets", "--all-namespaces")
	}

	canI("no", "get", "configmaps", "-n", ns)
	canI("no", "create", "pods", "-n", ns)
	canI("no", "delete", "inventorydrops.dropgate.io", "-n", ns)
	canI("yes", "patch", "inventorydrops.dropgate.io/status", "-n", ns)
	canI("yes", "update", "leases.coordination.k8s.io", "-n", operatorNS)
	canI("no", "update", "leases.coordination.k8s.io", "-n", "kube-system")

	// Nothing the operator tried was refused.
	if log, err := os.ReadFile(e.operator.log); err == nil && strings.Contains(strings.ToLower(string(log)), "forbidden") {
		t.Errorf("the operator was refused something (its log says forbidden): see %s", e.operator.log)
	}

	// A drop outside those namespaces that names a Secret, read as in a cluster (no
	// --redis-url override): the API server refuses the read, and the drop says how
	// to grant it.
	e.startOperatorWith(t, map[string]string{"DROPGATE_REDIS_URL": ""})
	e.kubectl(t, "-n", ns, "create", "secret", "generic", "sale-redis", "--from-literal=url="+e.redisURL)
	e.kubectlIn(t, dropYAML(ns, "secret-elsewhere", `{sku: X, limitedQuantity: 3, redis: {secretRef: {name: sale-redis, key: url}}}`), "apply", "-f", "-")
	e.waitCondition(t, ns, "inventorydrop/secret-elsewhere", "Ready", "False")
	said := ""
	e.eventually(t, "the drop names the missing grant", func() (bool, string) {
		msg, err := e.run("kubectl", "-n", ns, "get", "inventorydrop/secret-elsewhere", "-o",
			`jsonpath={.status.conditions[?(@.type=="Ready")].message}`)
		said = msg
		return err == nil && strings.Contains(msg, "operator.secretNamespaces") && !strings.Contains(msg, e.redisURL), msg
	})
	t.Logf("a drop whose Secret the operator may not read: %s", said)
	// The suite's operator again (its --redis-url lets both drops go).
	e.startOperator(t)
	e.deleteDrop(t, ns, "secret-elsewhere")

	e.kubectl(t, "-n", ns, "delete", "inventorydrop/rbac-drop", "--wait", "--timeout=120s")
	e.kubectl(t, "delete", "namespace", ns, "--wait=false")
}

// kubectl_apply_drop_lifecycle: the README's workflow. kubectl apply -> Ready with
// the finalizer, `kubectl get idrop` columns, a sidecar process sells, REMAINING
// follows, a changed limit restocks by the difference, the kill switch moves the
// sidecar to the fallback with an Event, re-enabling replays, and kubectl delete
// removes the Redis keys, then the object.
func kubectlApplyDropLifecycle(t *testing.T, e *env) {
	e.startOperator(t)
	e.ensureNamespace(t, shopNS)
	// A fresh sale, also on a cluster that a failed run left the drop in.
	e.kubectl(t, "-n", shopNS, "delete", dropObj, "--ignore-not-found", "--wait", "--timeout=120s")
	e.kubectl(t, "apply", "-f", e.path("examples/drop.yaml"))
	e.kubectl(t, "-n", shopNS, "wait", "--for=condition=Ready", dropObj, "--timeout=120s")
	e.waitField(t, shopNS, dropObj, "{.status.remaining}", "100")
	if f := e.jsonpath(t, shopNS, dropObj, "{.metadata.finalizers}"); !strings.Contains(f, finalizerName) {
		t.Fatalf("finalizers %s, want %s", f, finalizerName)
	}
	checkColumns(t, e, map[string]string{"SKU": "SNKR-0412", "LIMIT": "100", "REMAINING": "100", "MODE": "gate", "PHASE": "Active", "READY": "True"})

	// Sidecars for the namespace, as the webhook injects them into shop pods:
	// processes here. Two share a PostgreSQL ledger when the suite has one; a
	// per-pod SQLite ledger only serves one sidecar's fallback.
	sidecars := []*sidecar{e.startSidecar(t, "sidecar-a")}
	if e.databaseURL != "" {
		sidecars = append(sidecars, e.startSidecar(t, "sidecar-b"))
	}
	n := len(sidecars)
	a, b := sidecars[0], sidecars[n-1]
	for _, s := range sidecars {
		s.says(t, e, "remaining", "100")
	}

	// Sell three through the sidecars in turn, confirm two: REMAINING follows in
	// status and in `kubectl get`.
	for i, user := range []string{"alice", "bob", "carol"} {
		sidecars[i%n].reserve(t, fmt.Sprintf("order-%d", i+1), user, 201, "gate")
	}
	a.call(t, "POST", "/reservations/order-1/confirm", 200, "gate")
	b.call(t, "POST", "/reservations/order-2/confirm", 200, "gate")
	for _, s := range sidecars {
		s.says(t, e, "remaining", "97")
	}
	e.waitField(t, shopNS, dropObj, "{.status.remaining}", "97")
	checkColumns(t, e, map[string]string{"LIMIT": "100", "REMAINING": "97"})

	// A raised limit restocks by the difference; it never re-seeds.
	e.kubectl(t, "-n", shopNS, "patch", dropObj, "--type=merge", "-p", `{"spec":{"limitedQuantity":110}}`)
	e.waitField(t, shopNS, dropObj, "{.status.remaining}", "107")
	for _, s := range sidecars {
		s.says(t, e, "limit", "110")
		s.says(t, e, "remaining", "107")
	}
	checkColumns(t, e, map[string]string{"LIMIT": "110", "REMAINING": "107"})

	// The kill switch: status, an Event, and every sidecar on the fallback path.
	e.kubectl(t, "-n", shopNS, "patch", dropObj, "--type=merge", "-p", `{"spec":{"gate":{"enabled":false}}}`)
	e.waitField(t, shopNS, dropObj, "{.status.mode}", "fail-open")
	e.eventually(t, "a FailOpenEnabled Event for the drop", func() (bool, string) {
		out, err := e.run("kubectl", "-n", shopNS, "get", "events",
			"--field-selector", "reason=FailOpenEnabled,involvedObject.name="+dropName, "-o", "name")
		return err == nil && strings.TrimSpace(out) != "", fmt.Sprintf("%q %v", out, err)
	})
	checkColumns(t, e, map[string]string{"MODE": "fail-open"})
	for i, s := range sidecars {
		s.says(t, e, "mode", "fail-open")
		key := fmt.Sprintf("fallback-%d", i+1)
		s.reserve(t, key, fmt.Sprintf("fallback-buyer-%d", i+1), 201, "fallback")
		s.call(t, "POST", "/reservations/"+key+"/confirm", 200, "fallback")
	}

	// Re-enabled, the gate takes over again with the fallback's sales replayed into
	// Redis: n units fewer, and the gate knows the fallback's keys.
	left := 107 - n
	e.kubectl(t, "-n", shopNS, "patch", dropObj, "--type=merge", "-p", `{"spec":{"gate":{"enabled":true}}}`)
	e.waitField(t, shopNS, dropObj, "{.status.mode}", "gate")
	for i, s := range sidecars {
		s.says(t, e, "mode", "gate")
		s.says(t, e, "remaining", strconv.Itoa(left))
		got := s.reserve(t, fmt.Sprintf("fallback-%d", i+1), fmt.Sprintf("fallback-buyer-%d", i+1), 200, "gate")
		if got.field("outcome") != "already_reserved" {
			t.Fatalf("%s: the fallback's reservation was not replayed into the gate: %s", s.name, got)
		}
	}
	a.reserve(t, "order-4", "erin", 201, "gate")
	e.waitField(t, shopNS, dropObj, "{.status.remaining}", strconv.Itoa(left-1))
	checkColumns(t, e, map[string]string{"LIMIT": "110", "REMAINING": strconv.Itoa(left - 1), "MODE": "gate"})

	// kubectl delete: the finalizer removes the drop's Redis keys, then the object goes.
	for _, s := range sidecars {
		s.proc.stop() // so that nothing writes the drop's keys again
	}
	pattern := "*{" + shopNS + "/" + dropName + "}*"
	if keys := e.redisCLI(t, "--scan", "--pattern", pattern); strings.TrimSpace(keys) == "" {
		t.Fatalf("no Redis keys match %s before deletion: the check below would prove nothing", pattern)
	}
	e.kubectl(t, "-n", shopNS, "delete", dropObj, "--wait", "--timeout=120s")
	if _, err := e.run("kubectl", "-n", shopNS, "get", dropObj); err == nil {
		t.Fatalf("%s still exists after kubectl delete --wait", dropObj)
	}
	// Only the deletion tombstone stays (it tells sidecars the drop was deleted,
	// not lost, and expires by itself).
	var remains []string
	for _, key := range strings.Fields(e.redisCLI(t, "--scan", "--pattern", pattern)) {
		if !strings.HasSuffix(key, ":deleted") {
			remains = append(remains, key)
		}
	}
	if len(remains) > 0 {
		t.Fatalf("Redis keys left after the drop was deleted:\n%s", strings.Join(remains, "\n"))
	}
}

// dropManifest is examples/drop.yaml under another namespace, name and limit.
func dropManifest(t *testing.T, e *env, ns, name string, limit int) string {
	t.Helper()
	b, err := os.ReadFile(e.path("examples/drop.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	s := strings.Replace(string(b), "name: "+dropName, "name: "+name, 1)
	s = strings.Replace(s, "namespace: "+shopNS, "namespace: "+ns, 1)
	s = strings.Replace(s, "limitedQuantity: 100", fmt.Sprintf("limitedQuantity: %d", limit), 1)
	if s == string(b) {
		t.Fatal("examples/drop.yaml changed shape: update dropManifest")
	}
	return s
}

// checkColumns reads `kubectl get idrop` as a person does: the header names the
// columns, the drop's row holds the values.
func checkColumns(t *testing.T, e *env, want map[string]string) {
	t.Helper()
	e.eventually(t, fmt.Sprintf("kubectl get idrop shows %v", want), func() (bool, string) {
		out, err := e.run("kubectl", "-n", shopNS, "get", "idrop", dropName)
		if err != nil {
			return false, err.Error()
		}
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) != 2 {
			return false, out
		}
		header, row := strings.Fields(lines[0]), strings.Fields(lines[1])
		if strings.Join(header, " ") != "NAME SKU LIMIT REMAINING MODE PHASE READY AGE" || len(row) != len(header) {
			return false, out
		}
		for i, column := range header {
			if v, ok := want[column]; ok && row[i] != v {
				return false, out
			}
		}
		return true, out
	})
}

func containsFold(list []string, want string) bool {
	for _, s := range list {
		if strings.EqualFold(s, want) {
			return true
		}
	}
	return false
}

// sidecar is a dropgate-sidecar process serving the shop namespace.
type sidecar struct {
	name string
	proc *process
	base string // http://127.0.0.1:PORT/v1/drops/DROP
}

func (e *env) startSidecar(t *testing.T, name string) *sidecar {
	t.Helper()
	return e.startSidecarFor(t, name, shopNS, dropName)
}

// startSidecarFor starts a sidecar serving namespace ns, its requests aimed at the
// drop named drop.
func (e *env) startSidecarFor(t *testing.T, name, ns, drop string) *sidecar {
	t.Helper()
	return e.startSidecarWith(t, name, ns, drop, e.redisURL, nil)
}

// startSidecarWith is startSidecarFor with the sidecar's Redis at redisURL and
// more environment (NAME=value).
func (e *env) startSidecarWith(t *testing.T, name, ns, drop, redisURL string, vars []string) *sidecar {
	t.Helper()
	ledger := e.databaseURL
	if ledger == "" {
		file := filepath.Join(e.work, name+"-ledger.db")
		for _, suffix := range []string{"", "-wal", "-shm"} {
			_ = os.Remove(file + suffix) // a new pod starts with an empty ledger
		}
		ledger = "sqlite://" + file
	}
	port := freePort(t)
	p := e.start(t, name, filepath.Join(e.bin, "dropgate-sidecar"), []string{
		"--listen", fmt.Sprintf("127.0.0.1:%d", port),
		"--redis-url", redisURL,
		"--namespace", ns,
		"--database-url", ledger,
	}, append([]string{"DROPGATE_HEALTH_LISTEN=127.0.0.1:" + strconv.Itoa(freePort(t)), "RUST_LOG=info",
		// Without a watch (most scenarios), an outage's fallback decides on the
		// config last read, opted in; ignored by a sidecar that watches.
		"DROPGATE_FALLBACK_ON_LAST_READ_CONFIG=true"}, vars...))
	t.Cleanup(p.stop)
	return &sidecar{name: name, proc: p, base: fmt.Sprintf("http://127.0.0.1:%d/v1/drops/%s", port, drop)}
}

// says polls GET /v1/drops/DROP until field reads want.
func (s *sidecar) says(t *testing.T, e *env, field, want string) {
	t.Helper()
	e.eventually(t, fmt.Sprintf("%s: the drop's %s == %s", s.name, field, want), func() (bool, string) {
		if s.proc.exited() {
			t.Fatalf("%s exited: %v", s.name, s.proc.err)
		}
		a, err := call("GET", s.base, nil)
		if err != nil {
			return false, err.Error()
		}
		return a.status == 200 && a.field(field) == want, a.String()
	})
}

// call sends one request and checks its status and its path: "fallback" answers
// carry Dropgate-Path: fallback, "gate" answers do not.
func (s *sidecar) call(t *testing.T, method, path string, want int, via string) answer {
	t.Helper()
	return s.send(t, method, path, nil, want, via)
}

func (s *sidecar) reserve(t *testing.T, key, user string, want int, via string) answer {
	t.Helper()
	return s.send(t, "POST", "/reservations", map[string]any{"key": key, "user": user, "quantity": 1}, want, via)
}

func (s *sidecar) send(t *testing.T, method, path string, body any, want int, via string) answer {
	t.Helper()
	// A 503 with Retry-After says nothing was changed and to ask again (the other
	// sidecar may be opening the gate): a client does, with the same key.
	a, err := call(method, s.base+path, body)
	for deadline := time.Now().Add(10 * time.Second); err == nil && want != 503 &&
		a.status == 503 && a.header.Get("Retry-After") != "" && time.Now().Before(deadline); {
		time.Sleep(200 * time.Millisecond)
		a, err = call(method, s.base+path, body)
	}
	if err != nil {
		t.Fatalf("%s: %s %s: %v", s.name, method, path, err)
	}
	if a.status != want {
		t.Fatalf("%s: %s %s: want %d, got %s", s.name, method, path, want, a)
	}
	if got := a.header.Get("Dropgate-Path"); (got == "fallback") != (via == "fallback") {
		t.Fatalf("%s: %s %s answered on the wrong path (want %s, Dropgate-Path %q): %s", s.name, method, path, via, got, a)
	}
	return a
}
