package suite

import (
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// fallback_obeys_a_change_published_while_cut_off: a sidecar that cannot reach
// Redis (its connection runs through a proxy the test cuts; the operator's does
// not) sells on the fallback on the config of the drop's current generation. A
// limit cut applied while it is cut off is published by the operator into Redis,
// where this sidecar cannot read it: the sidecar learns of the new generation from
// the API server (as the chart's RBAC lets any service account), even with its
// watch lagging, because each fallback admission reads the drop there after it
// began; it refuses to decide on the config it read before, 503 and nothing
// changed, from the first reserve after the cut on. Back on Redis, it obeys the
// cut: sold out at the new limit, never past it.
func fallbackObeysAChangePublishedWhileCutOff(t *testing.T, e *env) {
	if e.databaseURL == "" {
		t.Skip("needs the suite's PostgreSQL ledger (a per-pod ledger's sidecar does not fall back alone)")
	}
	e.startOperator(t)
	ns, drop := "e2e-cut-off", "cut-sale"
	e.ensureNamespace(t, ns)
	t.Cleanup(func() { _, _ = e.run("kubectl", "delete", "namespace", ns, "--wait=false", "--ignore-not-found") })
	e.kubectlIn(t, dropYAML(ns, drop, `{sku: CUT-1, limitedQuantity: 10, redis: {url: "`+e.redisURL+`"}}`), "apply", "-f", "-")
	e.waitField(t, ns, "inventorydrop/"+drop, "{.status.mode}", "gate")

	// The chart's default sidecar.dropReaders lets the namespace's service accounts
	// watch drops (else the sidecar would never fall back, and this would wait).
	if can := strings.TrimSpace(e.kubectl(t, "auth", "can-i", "watch", "inventorydrops.dropgate.io", "-n", ns,
		"--as=system:serviceaccount:"+ns+":default")); can != "yes" {
		t.Fatalf("the chart does not let %s's service accounts watch InventoryDrops: %q", ns, can)
	}
	proxy := startProxy(t, strings.TrimPrefix(strings.TrimSuffix(e.redisURL, "/"), "redis://"))
	s := e.startSidecarWith(t, "cut-off-sidecar", ns, drop, "redis://"+proxy.addr,
		// Its watch lags: it takes in no change (fault point watch-lags), so only its
		// reads of the API server can tell it of one.
		[]string{"DROPGATE_WATCH_DROPS=true", "KUBECONFIG=" + e.tokenKubeconfig(t, ns, "default"), "DROPGATE_FAULTS=watch-lags"})
	s.says(t, e, "remaining", "10")
	s.reserve(t, "order-1", "alice", 201, "gate")
	s.reserve(t, "order-2", "bob", 201, "gate")

	// Cut off from Redis, the sidecar sells on the fallback: the drop in the API
	// server is of the generation it read.
	proxy.cut()
	a := s.reserveUntil(t, e, "order-3", "carol", 201)
	if a.header.Get("Dropgate-Path") != "fallback" {
		t.Fatalf("sold while cut off from Redis, but not on the fallback: %s", a)
	}

	// The limit cut to 3 (3 sold). A reserve sent as soon as the API server took it
	// is refused: its check reads the drop from the API server after it began,
	// whether or not the watch or the operator has caught up.
	generation := strings.TrimSpace(e.kubectl(t, "-n", ns, "patch", "inventorydrop/"+drop, "--type=merge",
		"-p", `{"spec":{"limitedQuantity":3}}`, "-o", "jsonpath={.metadata.generation}"))
	if refused := s.reserve(t, "order-4", "dave", 503, "fallback"); !strings.Contains(refused.field("message"), "generation "+generation) {
		t.Fatalf("a reserve right after the cut should be refused naming generation %s: %s", generation, refused)
	}
	// The operator publishes it into Redis, which this sidecar cannot read.
	e.waitField(t, ns, "inventorydrop/"+drop, "{.status.observedGeneration}", generation)
	if limit := strings.TrimSpace(e.redisCLI(t, "HGET", fmt.Sprintf("dropgate:{%s/%s}:config", ns, drop), "limit")); limit != "3" {
		t.Fatalf("the operator published limit %q into Redis, want 3", limit)
	}
	// Published and in the drop's status since: still refused.
	refused := s.reserve(t, "order-4", "dave", 503, "fallback")
	if !strings.Contains(refused.field("message"), "generation "+generation) {
		t.Fatalf("the refusal should name the generation it has not read: %s", refused)
	}

	// Back on Redis: it reads the cut and sells nothing past it (on whichever gate
	// decides the drop now: the fallback's until its sales are back in Redis).
	proxy.restore()
	s.says(t, e, "limit", "3")
	if a := s.reserveUntil(t, e, "order-4", "dave", 409); a.field("outcome") != "sold_out" {
		t.Fatalf("after the cut to 3 with 3 sold: %s", a)
	}
	s.says(t, e, "remaining", "0")
}

// reserveUntil repeats a reserve of key (the same key: a 503 changed nothing)
// while it answers 503, until it answers want, on either path; any other answer
// fails the test.
func (s *sidecar) reserveUntil(t *testing.T, e *env, key, user string, want int) answer {
	t.Helper()
	var got answer
	e.eventually(t, fmt.Sprintf("%s: reserve %s answered %d", s.name, key, want), func() (bool, string) {
		a, err := call("POST", s.base+"/reservations", map[string]any{"key": key, "user": user, "quantity": 1})
		if err != nil {
			return false, err.Error()
		}
		if a.status != want && a.status != 503 {
			t.Fatalf("%s: reserve %s: want %d (or 503 until then), got %s", s.name, key, want, a)
		}
		got = a
		return a.status == want, a.String()
	})
	return got
}

// tcpProxy forwards connections to a target until cut (listener closed and every
// open connection reset), and again after restore, on the same port.
type tcpProxy struct {
	addr, target string
	mu           sync.Mutex
	listener     net.Listener
	conns        []net.Conn
}

func startProxy(t *testing.T, target string) *tcpProxy {
	t.Helper()
	p := &tcpProxy{addr: fmt.Sprintf("127.0.0.1:%d", freePort(t)), target: target}
	p.restore()
	t.Cleanup(p.cut)
	return p
}

func (p *tcpProxy) restore() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.listener != nil {
		return
	}
	l, err := net.Listen("tcp", p.addr)
	if err != nil {
		panic(fmt.Sprintf("proxy: listen on %s again: %v", p.addr, err))
	}
	p.listener = l
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			upstream, err := net.Dial("tcp", p.target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			if p.listener != l {
				p.mu.Unlock()
				c.Close()
				upstream.Close()
				return
			}
			p.conns = append(p.conns, c, upstream)
			p.mu.Unlock()
			go func() { _, _ = io.Copy(upstream, c); upstream.Close() }()
			go func() { _, _ = io.Copy(c, upstream); c.Close() }()
		}
	}()
}

func (p *tcpProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.listener != nil {
		p.listener.Close()
		p.listener = nil
	}
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// fallback_waits_for_a_watch_it_may_not_run: a sidecar whose identity may not
// watch drops (a user RBAC grants nothing, impersonated from the suite's admin
// kubeconfig, checked with `kubectl auth can-i`) sells on the gate as any other,
// but once cut off from Redis it cannot tell whether the config it holds is
// current: its reserves answer 503 "retry", however often they are repeated, and
// change nothing. Back on Redis it sells again, and the drop counts only the
// gate's sales.
func fallbackWaitsForAWatchItMayNotRun(t *testing.T, e *env) {
	if e.databaseURL == "" {
		t.Skip("needs the suite's PostgreSQL ledger (a per-pod ledger's sidecar does not fall back alone)")
	}
	e.startOperator(t)
	ns, drop, nobody := "e2e-no-watch", "unwatched-sale", "dropgate-e2e-nobody"
	e.ensureNamespace(t, ns)
	t.Cleanup(func() { _, _ = e.run("kubectl", "delete", "namespace", ns, "--wait=false", "--ignore-not-found") })
	e.kubectlIn(t, dropYAML(ns, drop, `{sku: NOWATCH-1, limitedQuantity: 10, redis: {url: "`+e.redisURL+`"}}`), "apply", "-f", "-")
	e.waitField(t, ns, "inventorydrop/"+drop, "{.status.mode}", "gate")
	if can, _ := e.run("kubectl", "auth", "can-i", "watch", "inventorydrops.dropgate.io", "-n", ns, "--as="+nobody); strings.TrimSpace(can) != "no" {
		t.Fatalf("%s should not be let watch InventoryDrops: %q", nobody, can)
	}

	proxy := startProxy(t, strings.TrimPrefix(strings.TrimSuffix(e.redisURL, "/"), "redis://"))
	s := e.startSidecarWith(t, "unwatched-sidecar", ns, drop, "redis://"+proxy.addr,
		[]string{"DROPGATE_WATCH_DROPS=true", "KUBECONFIG=" + e.impersonatingKubeconfig(t, nobody)})
	s.says(t, e, "remaining", "10")
	s.reserve(t, "order-1", "alice", 201, "gate")

	// Cut off: every try of the same reserve, for longer than a read of the API
	// server stands for, answers 503 "retry the same key" (first while the sidecar
	// makes sure Redis is away, then on the fallback, naming the watch).
	proxy.cut()
	for try := 0; try < 8; try++ {
		a, err := call("POST", s.base+"/reservations", map[string]any{"key": "order-2", "user": "bob", "quantity": 1})
		if err != nil {
			t.Fatalf("reserve while cut off: %v", err)
		}
		if a.status != 503 || a.field("keySpent") == "true" {
			t.Fatalf("a sidecar that may not watch drops must not decide on the fallback: %s", a)
		}
		time.Sleep(300 * time.Millisecond)
	}
	if a := s.reserve(t, "order-2", "bob", 503, "fallback"); !strings.Contains(a.field("message"), "watch") {
		t.Fatalf("the refusal should say the watch is why: %s", a)
	}

	// Back on Redis: the refused reserve is decided afresh on the gate, and the drop
	// counts the two gate sales, nothing from the refusals.
	proxy.restore()
	s.reserveUntil(t, e, "order-2", "bob", 201)
	s.says(t, e, "remaining", "8")
}

// impersonatingKubeconfig writes a kubeconfig with the suite's admin credentials
// that acts as user (the API server checks what RBAC grants user, not the admin).
// Returns its path.
func (e *env) impersonatingKubeconfig(t *testing.T, user string) string {
	t.Helper()
	admin, err := os.ReadFile(e.kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	// The control plane writes one user, its credentials under "  user:".
	const credentials = "\n  user:\n"
	if strings.Count(string(admin), credentials) != 1 {
		t.Fatalf("%s: want one user's credentials to add `as` to:\n%s", e.kubeconfig, admin)
	}
	config := strings.Replace(string(admin), credentials, credentials+"    as: "+user+"\n", 1)
	path := filepath.Join(e.work, user+".kubeconfig")
	if err := os.WriteFile(path, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
