package suite

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Bounds: every command, request and wait of the suite ends by itself.
const (
	commandTimeout = 2 * time.Minute
	// waitTimeout is a generous deadline for what the system does by itself
	// (reconciles, resyncs, config refreshes): the suite polls, it never asserts
	// that something happened within a given time.
	waitTimeout  = 2 * time.Minute
	pollInterval = 250 * time.Millisecond
	stopTimeout  = 15 * time.Second
)

const (
	release    = "dropgate"
	operatorNS = "dropgate-system"
	operatorSA = "dropgate-operator"
	// The namespace whose Secrets the chart lets the operator read
	// (operator.secretNamespaces); never deleted by a scenario, so that a later
	// `helm upgrade` renders its Role into a namespace that exists.
	secretsNS     = "e2e-secrets"
	operatorID    = "e2e-operator"
	finalizerName = "dropgate.io/cleanup"
	leaseName     = "dropgate-operator" // the chart's DROPGATE_LEASE_NAME
	// resyncSeconds keeps REMAINING current in status; the suite only polls for it.
	resyncSeconds = "2"
)

// env is what the scenarios share: the cluster, the Redis, and the processes that
// the suite starts once (the chart release and the operator).
type env struct {
	repo, bin, work      string
	kubeconfig, redisURL string
	databaseURL          string // a shared ledger for the sidecars; "" = SQLite each
	helmSet              string

	installed     bool
	operator      *process
	operatorSet   map[string]string // the settings it runs with
	operatorAdmin string            // host:port of its /metrics
	saConfig      string            // kubeconfig holding the operator ServiceAccount's token
	procs         []*process
}

// run runs a command with the cluster's kubeconfig, bounded by commandTimeout.
func (e *env) run(name string, args ...string) (string, error) {
	return e.runIn("", name, args...)
}

func (e *env) runIn(stdin, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+e.kubeconfig,
		// kubectl's discovery cache and helm's folders stay in this run's work
		// folder: nothing from an earlier cluster on the same port is reused.
		"KUBECACHEDIR="+filepath.Join(e.work, "kube-cache"),
		"HELM_CACHE_HOME="+filepath.Join(e.work, "helm", "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(e.work, "helm", "config"),
		"HELM_DATA_HOME="+filepath.Join(e.work, "helm", "data"))
	cmd.Dir = e.repo
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	err := cmd.Run()
	if err != nil {
		return stdout.String(), fmt.Errorf("%s %s: %v: %s%s", name, strings.Join(args, " "), err, stderr.String(), stdout.String())
	}
	return stdout.String(), nil
}

// must runs a command and fails the test when it fails.
func (e *env) must(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := e.run(name, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func (e *env) kubectl(t *testing.T, args ...string) string {
	t.Helper()
	return e.must(t, "kubectl", args...)
}

// kubectlIn pipes a manifest into kubectl (for example `apply -f -`).
func (e *env) kubectlIn(t *testing.T, manifest string, args ...string) string {
	t.Helper()
	out, err := e.runIn(manifest, "kubectl", args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func (e *env) redisCLI(t *testing.T, args ...string) string {
	t.Helper()
	return e.must(t, "redis-cli", append([]string{"-u", e.redisURL}, args...)...)
}

// path is a file of the repository.
func (e *env) path(rel string) string { return filepath.Join(e.repo, rel) }

// ensureNamespace creates a namespace unless it exists.
func (e *env) ensureNamespace(t *testing.T, ns string) {
	t.Helper()
	manifest := e.kubectl(t, "create", "namespace", ns, "--dry-run=client", "-o", "yaml")
	e.kubectlIn(t, manifest, "apply", "-f", "-")
}

// installChart installs (or upgrades) charts/dropgate once per run.
func (e *env) installChart(t *testing.T) {
	t.Helper()
	if e.installed {
		return
	}
	// The operator's namespace enforces Pod Security "restricted", as a careful
	// cluster does: the chart's Pods must pass it to be stored.
	e.ensureNamespace(t, operatorNS)
	e.kubectl(t, "label", "--overwrite", "namespace", operatorNS, "pod-security.kubernetes.io/enforce=restricted")
	// Secrets are granted per namespace (the chart's default): the suite's one
	// namespace for drops whose URL lives in a Secret exists first.
	e.ensureNamespace(t, secretsNS)
	args := []string{"upgrade", "--install", release, e.path("charts/dropgate"),
		"--namespace", operatorNS, "--create-namespace",
		"--set-json", `operator.secretNamespaces=["` + secretsNS + `"]`}
	if e.helmSet != "" {
		args = append(args, "--set", e.helmSet)
	}
	e.must(t, "helm", args...)
	e.installed = true
}

// startOperator makes sure that the suite's operator runs `dropgate-operator run`
// with the suite's default settings (operatorSettings), as the chart's
// ServiceAccount: its kubeconfig holds a token from `kubectl create token`, so the
// chart's RBAC is all that it may do. It starts once per run, and again after a
// scenario ran it with other settings.
func (e *env) startOperator(t *testing.T) {
	t.Helper()
	e.startOperatorWith(t, nil)
}

// startOperatorWith is startOperator with some settings changed (name -> value; ""
// leaves the variable out). An operator running with other settings is stopped
// first (SIGTERM: it releases the Lease) and started again.
func (e *env) startOperatorWith(t *testing.T, changes map[string]string) {
	t.Helper()
	e.installChart(t)
	settings := e.operatorSettings(t, changes)
	if e.operator != nil {
		if e.operator.exited() {
			t.Fatalf("the suite's operator exited (%v): see %s", e.operator.err, e.operator.log)
		}
		if maps.Equal(settings, e.operatorSet) {
			return
		}
	}
	e.launchOperator(t, settings)
}

// restartOperator stops the suite's operator and starts a fresh process with the
// same settings: nothing it cached in memory survives.
func (e *env) restartOperator(t *testing.T) {
	t.Helper()
	if e.operator == nil || e.operator.exited() {
		t.Fatal("restartOperator: the suite's operator is not running")
	}
	e.launchOperator(t, e.operatorSet)
}

// launchOperator (re)starts the suite's operator and waits until it leads.
func (e *env) launchOperator(t *testing.T, settings map[string]string) {
	t.Helper()
	e.stopOperator()
	e.operatorAdmin = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	e.operator = e.startOperatorProcess(t, "operator", settings, e.operatorAdmin)
	e.operatorSet = settings
	// It leads once the Lease names it.
	e.eventually(t, "the operator holds the leader Lease", func() (bool, string) {
		holder, err := e.run("kubectl", "-n", operatorNS, "get", "lease", leaseName,
			"-o", "jsonpath={.spec.holderIdentity}")
		return err == nil && holder == operatorID, fmt.Sprintf("holder %q, %v", holder, err)
	})
}

// stopOperator stops the suite's operator (SIGTERM); the next startOperator starts
// it again.
func (e *env) stopOperator() {
	if e.operator != nil {
		e.operator.stop()
		e.operator = nil
	}
}

// operatorSettings is the environment of an operator process (its admin port
// aside): the suite's defaults with changes applied ("" leaves a variable out).
func (e *env) operatorSettings(t *testing.T, changes map[string]string) map[string]string {
	t.Helper()
	e.writeOperatorKubeconfig(t)
	settings := map[string]string{
		"KUBECONFIG":              e.saConfig,
		"POD_NAME":                operatorID,
		"POD_NAMESPACE":           operatorNS,
		"DROPGATE_RESYNC_SECONDS": resyncSeconds,
		"DROPGATE_LEASE_SECONDS":  "15",
		// Every drop's Redis is the suite's; nothing is sent anywhere else.
		"DROPGATE_REDIS_URL":            e.redisURL,
		"DROPGATE_MEMORYSTORE_ENDPOINT": "http://127.0.0.1:9",
		"DROPGATE_METADATA_ENDPOINT":    "http://127.0.0.1:9",
		"RUST_LOG":                      "info",
	}
	for name, value := range changes {
		if value == "" {
			delete(settings, name)
		} else {
			settings[name] = value
		}
	}
	return settings
}

// startOperatorProcess runs one `dropgate-operator run` process with these
// settings, serving /metrics on admin.
func (e *env) startOperatorProcess(t *testing.T, name string, settings map[string]string, admin string) *process {
	t.Helper()
	vars := []string{"DROPGATE_ADMIN_LISTEN=" + admin}
	for _, k := range slices.Sorted(maps.Keys(settings)) {
		vars = append(vars, k+"="+settings[k])
	}
	return e.start(t, name, filepath.Join(e.bin, "dropgate-operator"), []string{"run"}, vars)
}

// writeOperatorKubeconfig writes, once, a kubeconfig with a token of the chart's
// ServiceAccount.
func (e *env) writeOperatorKubeconfig(t *testing.T) {
	t.Helper()
	if e.saConfig != "" {
		return
	}
	e.saConfig = e.tokenKubeconfig(t, operatorNS, operatorSA)
}

// tokenKubeconfig writes a kubeconfig holding a token of service account ns/sa
// (from `kubectl create token`): a process using it may do what RBAC grants that
// account, as in a pod that mounts its token. Returns its path.
func (e *env) tokenKubeconfig(t *testing.T, ns, sa string) string {
	t.Helper()
	token := strings.TrimSpace(e.kubectl(t, "-n", ns, "create", "token", sa, "--duration=2h"))
	server := e.kubectl(t, "config", "view", "--raw", "--minify", "-o", "jsonpath={.clusters[0].cluster.server}")
	ca := e.kubectl(t, "config", "view", "--raw", "--minify", "-o", "jsonpath={.clusters[0].cluster.certificate-authority-data}")
	path := filepath.Join(e.work, ns+"-"+sa+".kubeconfig")
	config := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {server: %q, certificate-authority-data: %q}
users:
- name: %s
  user: {token: %q}
contexts:
- name: e2e
  context: {cluster: e2e, user: %s}
current-context: e2e
`, server, ca, sa, token, sa)
	if err := os.WriteFile(path, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// process is a program the suite started, with its output in a log file.
type process struct {
	name     string
	cmd      *exec.Cmd
	log      string
	done     chan struct{}
	err      error
	exitedAt time.Time // valid once done is closed
}

// start runs a program in the background; it is stopped at the end of the run
// (stopAll) or by stop.
func (e *env) start(t *testing.T, name, program string, args, envVars []string) *process {
	t.Helper()
	logName := name
	for n := 2; slices.ContainsFunc(e.procs, func(p *process) bool { return p.name == logName }); n++ {
		logName = fmt.Sprintf("%s-%d", name, n) // a restarted process keeps its predecessor's log
	}
	name = logName
	logPath := filepath.Join(e.work, name+".log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(program, args...)
	cmd.Env = append(os.Environ(), envVars...)
	cmd.Dir = e.work
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = childAttrs()
	if err := cmd.Start(); err != nil {
		logFile.Close()
		t.Fatalf("start %s: %v", name, err)
	}
	p := &process{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		p.exitedAt = time.Now()
		logFile.Close()
		close(p.done)
	}()
	e.procs = append(e.procs, p)
	return p
}

// stop sends SIGTERM, waits (bounded), then kills.
func (p *process) stop() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(stopTimeout):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (e *env) stopAll() {
	for i := len(e.procs) - 1; i >= 0; i-- {
		e.procs[i].stop()
	}
}

// dumpLogs shows the end of every process log after a failure.
func (e *env) dumpLogs(t *testing.T) {
	for _, p := range e.procs {
		b, err := os.ReadFile(p.log)
		if err != nil {
			continue
		}
		lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
		if len(lines) > 40 {
			lines = lines[len(lines)-40:]
		}
		t.Logf("--- last lines of %s (%s):\n%s", p.name, p.log, strings.Join(lines, "\n"))
	}
}

// eventually polls check until it holds, failing the test with the last
// observation after waitTimeout. Deadlines are generous on purpose: the suite
// checks what happens, not how fast.
func (e *env) eventually(t *testing.T, what string, check func() (bool, string)) {
	t.Helper()
	e.eventuallyWithin(t, waitTimeout, what, check)
}

// eventuallyWithin is eventually with another deadline: only for a bound that the
// behaviour itself defines (a lease duration, "within a minute").
func (e *env) eventuallyWithin(t *testing.T, timeout time.Duration, what string, check func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	last := ""
	for {
		ok, seen := check()
		if ok {
			return
		}
		last = seen
		if e.operator != nil && e.operator.exited() {
			t.Fatalf("waiting for %s: the operator exited (%v); last seen: %s", what, e.operator.err, last)
		}
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s after %s; last seen: %s", what, timeout, last)
		}
		time.Sleep(pollInterval)
	}
}

// jsonpath reads one field of an object with kubectl.
func (e *env) jsonpath(t *testing.T, ns, object, path string) string {
	t.Helper()
	return e.kubectl(t, "-n", ns, "get", object, "-o", "jsonpath="+path)
}

// waitField polls a field of an object until it equals want.
func (e *env) waitField(t *testing.T, ns, object, path, want string) {
	t.Helper()
	e.eventually(t, fmt.Sprintf("%s %s == %q", object, path, want), func() (bool, string) {
		got, err := e.run("kubectl", "-n", ns, "get", object, "-o", "jsonpath="+path)
		if err != nil {
			return false, err.Error()
		}
		return got == want, fmt.Sprintf("%q", got)
	})
}

// The ports freePort handed out: it never hands one out twice.
var (
	portsMu   sync.Mutex
	handedOut = map[int]bool{}
)

// freePort returns a loopback port nothing listens on, for a program the suite
// starts next. It picks below the kernel's ephemeral range: a port from that
// range (what ":0" gives) can be taken by any outgoing connection, helm's or the
// API server's, between this check and the program's bind, and the program then
// fails with "Address already in use".
func freePort(t *testing.T) int {
	t.Helper()
	portsMu.Lock()
	defer portsMu.Unlock()
	const lowest = 10000
	below := ephemeralStart()
	if below-lowest < 1000 {
		t.Fatalf("the ephemeral port range starts at %d: no room below it for the suite's ports", below)
	}
	first := lowest + rand.IntN(below-lowest)
	for i := range below - lowest {
		port := lowest + (first-lowest+i)%(below-lowest)
		if handedOut[port] {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue
		}
		_ = l.Close()
		handedOut[port] = true
		return port
	}
	t.Fatalf("no free loopback port in %d-%d", lowest, below-1)
	return 0
}

// ephemeralStart is the first port the kernel hands to outgoing connections.
func ephemeralStart() int {
	raw, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768 // Linux's default
	}
	fields := strings.Fields(string(raw))
	if len(fields) != 2 {
		return 32768
	}
	start, err := strconv.Atoi(fields[0])
	if err != nil {
		return 32768
	}
	return start
}

// answer is one HTTP answer of the sidecar.
type answer struct {
	status int
	header http.Header
	body   map[string]any
	raw    string
}

func (a answer) String() string { return fmt.Sprintf("%d %s", a.status, a.raw) }

func (a answer) field(name string) string {
	v, ok := a.body[name]
	if !ok {
		return ""
	}
	if s, ok := v.(string); ok {
		return s
	}
	b, _ := json.Marshal(v)
	return string(b)
}

var httpClient = &http.Client{Timeout: 10 * time.Second}

// call sends one request to a loopback address.
func call(method, url string, body any) (answer, error) {
	var reader io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return answer{}, err
		}
		reader = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, url, reader)
	if err != nil {
		return answer{}, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return answer{}, err
	}
	a := answer{status: resp.StatusCode, header: resp.Header, raw: strings.TrimSpace(string(raw))}
	_ = json.Unmarshal(raw, &a.body)
	return a, nil
}

// mustCall sends one request and fails the test unless the status is want.
func mustCall(t *testing.T, method, url string, body any, want int) answer {
	t.Helper()
	a, err := call(method, url, body)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	if a.status != want {
		t.Fatalf("%s %s: want %d, got %s", method, url, want, a)
	}
	return a
}
