package suite

import (
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
)

// fallback_obeys_a_change_published_while_cut_off: a sidecar that cannot reach
// Redis (its connection runs through a proxy the test cuts; the operator's does
// not) sells on the fallback on the config of the drop's current generation. A
// limit cut applied while it is cut off is published by the operator into Redis,
// where this sidecar cannot read it: the sidecar learns of the new generation from
// its watch of the API server (as the chart's RBAC lets any service account) and
// refuses to decide on the config it read before, 503 and nothing changed. Back on
// Redis, it obeys the cut: sold out at the new limit, never past it.
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
		[]string{"DROPGATE_WATCH_DROPS=true", "KUBECONFIG=" + e.tokenKubeconfig(t, ns, "default")})
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

	// The limit cut to 3 (3 sold): the operator publishes it into Redis, which this
	// sidecar cannot read.
	e.kubectl(t, "-n", ns, "patch", "inventorydrop/"+drop, "--type=merge", "-p", `{"spec":{"limitedQuantity":3}}`)
	generation := e.jsonpath(t, ns, "inventorydrop/"+drop, "{.metadata.generation}")
	e.waitField(t, ns, "inventorydrop/"+drop, "{.status.observedGeneration}", generation)
	if limit := strings.TrimSpace(e.redisCLI(t, "HGET", fmt.Sprintf("dropgate:{%s/%s}:config", ns, drop), "limit")); limit != "3" {
		t.Fatalf("the operator published limit %q into Redis, want 3", limit)
	}
	// The watch heard the change about when the operator did, and the operator has
	// published it and written its status since: the sidecar knows.
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
