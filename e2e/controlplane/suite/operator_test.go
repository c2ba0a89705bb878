package suite

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The operator in a real cluster (issue 9): its own status writes do not wake it,
// one replica acts at a time and hands over on SIGTERM, a drop whose cleanup
// cannot succeed still goes, the API server refuses bad drops, and an HA check
// that could not be made is not a verdict.

// no_self_triggered_reconcile: during a sale whose stock moves all the time, the
// operator's status writes do not wake it again: reconciles and status patches
// (its /metrics) stay within one per resync per drop, while status REMAINING
// still follows the sale.
func noSelfTriggeredReconcile(t *testing.T, e *env) {
	const sale = 20 * time.Second
	e.startOperator(t)
	ns, name := "e2e-steady", "steady-sale"
	obj := "inventorydrop/" + name
	e.createDrop(t, ns, name, `{sku: STEADY-1, limitedQuantity: 100000, redis: {url: "`+e.redisURL+`"}}`)
	s := e.startSidecarFor(t, "sidecar-steady", ns, name)
	s.says(t, e, "remaining", "100000")

	drops := e.dropCount(t)
	before := e.operatorMetrics(t)
	started := time.Now()
	sold := 0
	for time.Since(started) < sale {
		key := fmt.Sprintf("steady-%d", sold)
		s.reserve(t, key, fmt.Sprintf("buyer-%d", sold), 201, "gate")
		s.call(t, "POST", "/reservations/"+key+"/confirm", 200, "gate")
		sold++
		time.Sleep(20 * time.Millisecond)
	}
	window := time.Since(started)
	after := e.operatorMetrics(t)
	drops = max(drops, e.dropCount(t))

	// The budget: one reconcile (and one status patch) per resync per drop, one
	// more for a resync already due, and a little slack.
	resync, _ := strconv.Atoi(resyncSeconds)
	perDrop := int(window/(time.Duration(resync)*time.Second)) + 1
	budget := drops*perDrop + 3
	reconciles := after.delta(before, "dropgate_operator_reconciliations_total")
	patches := after.delta(before, "dropgate_operator_status_patches_total")
	t.Logf("%d sales in %s: %d reconciles, %d status patches, %d drop(s) in the cluster, budget %d",
		sold, window.Round(time.Millisecond), reconciles, patches, drops, budget)
	if reconciles > budget {
		t.Errorf("%d reconciles in %s for %d drop(s) with a %ss resync: more than the budget of %d (status writes wake the controller)",
			reconciles, window.Round(time.Second), drops, resyncSeconds, budget)
	}
	if patches > budget {
		t.Errorf("%d status patches in %s for %d drop(s) with a %ss resync: more than the budget of %d",
			patches, window.Round(time.Second), drops, resyncSeconds, budget)
	}
	// Not vacuous: the resync ran, and status followed the moving stock.
	if minimum := perDrop / 2; reconciles < minimum || patches < minimum {
		t.Errorf("%d reconciles and %d status patches in %s: the %ss resync did not run (want at least %d)",
			reconciles, patches, window.Round(time.Second), resyncSeconds, minimum)
	}
	e.waitField(t, ns, obj, "{.status.remaining}", strconv.Itoa(100000-sold))

	s.proc.stop()
	e.deleteDrop(t, ns, name)
}

// leader_failover: operator replicas share the Lease and only the one that holds
// it acts. kill -9 of the leader: another takes over, but only after the Lease
// went unrenewed for a whole lease duration. SIGTERM ends either role within 5 s,
// and a leader releases the Lease on the way out, so the next takes over at once
// instead of after a lease duration. A leader cut off from the API server stops
// (exits non-zero) before any follower may take the Lease.
func leaderFailover(t *testing.T, e *env) {
	e.startOperator(t)
	ns, name := "e2e-lease", "lease-sale"
	e.createDrop(t, ns, name, `{sku: LEASE-1, limitedQuantity: 10, redis: {url: "`+e.redisURL+`"}}`)

	// The suite's operator steps aside (SIGTERM): as the leader it releases the
	// Lease. It is started again at the end.
	e.stopOperator()
	if l := e.lease(t); l.Holder != "" {
		t.Errorf("the suite's operator exited on SIGTERM without releasing the Lease: %s", l)
	}

	// a leads with a 10 s Lease; b follows (30 s, which it writes once it leads).
	a := e.startReplica(t, "e2e-replica-a", 10)
	e.eventually(t, a.id+" leads", func() (bool, string) { return e.leads(a) })
	b := e.startReplica(t, "e2e-replica-b", 30)
	e.onlyOneActs(t, a, b)

	// kill -9: a cannot release. b takes over once the Lease went unchanged for
	// a's lease duration by b's own clock: not before a's last renewal (at most a
	// retry period before the kill) plus that duration.
	before := e.lease(t)
	killed := time.Now()
	a.proc.kill()
	e.eventuallyWithin(t, 3*(a.lease+b.retryPeriod()), b.id+" takes over the Lease of the killed "+a.id,
		func() (bool, string) { return e.leads(b) })
	took := time.Since(killed)
	t.Logf("%s took the Lease %s after %s was killed", b.id, took.Round(time.Millisecond), a.id)
	if earliest := a.lease - a.retryPeriod(); took < earliest {
		t.Errorf("%s took the Lease %s after %s was killed, before it can have seen it unrenewed for %s",
			b.id, took.Round(time.Millisecond), a.id, a.lease)
	}
	e.handedOver(t, before, b)

	// SIGTERM of the leader: it exits within 5 s, released, and c takes over far
	// sooner than b's 30 s Lease would expire.
	c := e.startReplica(t, "e2e-replica-c", 10)
	e.onlyOneActs(t, b, c)
	before = e.lease(t)
	signalled := time.Now()
	b.proc.terminate(t, 5*time.Second)
	e.eventuallyWithin(t, time.Until(signalled.Add(b.lease/3)), c.id+" takes over the Lease that "+b.id+" released",
		func() (bool, string) { return e.leads(c) })
	t.Logf("%s took the Lease %s after SIGTERM of %s", c.id, time.Since(signalled).Round(time.Millisecond), b.id)
	e.handedOver(t, before, c)

	// SIGTERM of a follower: it exits within 5 s and leaves the Lease alone.
	x := e.startReplica(t, "e2e-replica-x", 10)
	e.onlyOneActs(t, c, x)
	before = e.lease(t)
	x.proc.terminate(t, 5*time.Second)
	if after := e.lease(t); after.Holder != c.id || after.Transitions != before.Transitions {
		t.Errorf("a follower's exit changed the Lease: %s, then %s", before, after)
	}

	// The leader loses the API server: it stops, non-zero, before d may take over.
	d := e.startReplica(t, "e2e-replica-d", 10)
	e.onlyOneActs(t, c, d)
	before = e.lease(t)
	c.line.cut()
	e.eventuallyWithin(t, 3*(c.lease+d.retryPeriod()), d.id+" takes over from "+c.id+", cut off",
		func() (bool, string) { return e.leads(d) })
	e.handedOver(t, before, d)
	acquired, err := time.Parse(time.RFC3339Nano, e.lease(t).AcquireTime)
	switch {
	case err != nil:
		t.Errorf("the Lease's acquireTime: %v", err)
	case !c.proc.exited():
		t.Errorf("%s, cut off from the API server, still runs after %s took the Lease", c.id, d.id)
	case c.proc.err == nil:
		t.Errorf("%s exited successfully after losing the Lease: want a failure", c.id)
	case !c.proc.exitedAt.Before(acquired):
		t.Errorf("%s took the Lease at %s, before %s stopped leading at %s",
			d.id, acquired.Format(time.RFC3339Nano), c.id, c.proc.exitedAt.Format(time.RFC3339Nano))
	default:
		t.Logf("%s stopped (%v) %s before %s took the Lease", c.id, c.proc.err,
			acquired.Sub(c.proc.exitedAt).Round(time.Millisecond), d.id)
	}

	// The last replica goes: the Lease is left released, nobody holds it.
	d.proc.terminate(t, 5*time.Second)
	if l := e.lease(t); l.Holder != "" {
		t.Errorf("%s exited on SIGTERM without releasing the Lease: %s", d.id, l)
	}

	e.startOperator(t)
	e.deleteDrop(t, ns, name)
}

// namespace_deletion_finishes: a drop whose Redis URL lives in a Secret, the
// Secret deleted first, then the namespace: the cleanup cannot find its Redis (a
// cause no retry fixes), so the operator lets the drop go with a Warning naming
// the keys it leaves to their TTLs, and the namespace goes too.
func namespaceDeletionFinishes(t *testing.T, e *env) {
	// As in a cluster: each drop's Redis from its own spec, no --redis-url
	// override, so that secretRef is read from the Secret.
	e.startOperatorWith(t, map[string]string{"DROPGATE_REDIS_URL": ""})
	ns, name := "e2e-nsdel", "secret-sale"
	obj := "inventorydrop/" + name
	e.ensureNamespace(t, ns)
	// The operator reads Secrets only where it is granted (the chart grants the
	// namespaces of operator.secretNamespaces): granted here as the chart would.
	e.kubectl(t, "-n", ns, "create", "role", "dropgate-operator-secrets", "--verb=get", "--resource=secrets")
	e.kubectl(t, "-n", ns, "create", "rolebinding", "dropgate-operator-secrets", "--role=dropgate-operator-secrets",
		"--serviceaccount="+operatorNS+":"+operatorSA)
	e.kubectl(t, "-n", ns, "create", "secret", "generic", "sale-redis", "--from-literal=url="+e.redisURL)
	endsAt := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
	e.createDrop(t, ns, name, `{sku: NSDEL-1, limitedQuantity: 10, endsAt: "`+endsAt+`", redis: {secretRef: {name: sale-redis, key: url}}}`)
	e.waitField(t, ns, obj, "{.status.mode}", "gate")
	pattern := "dropgate:{" + ns + "/" + name + "}:*"
	if keys := e.redisCLI(t, "--scan", "--pattern", pattern); strings.TrimSpace(keys) == "" {
		t.Fatalf("the drop was not seeded: no Redis key matches %s", pattern)
	}
	// Events in a namespace being deleted may be refused: watch for it meanwhile.
	events := e.start(t, "events-"+ns, "kubectl", []string{"-n", ns, "get", "events", "--watch", "-o", "json"},
		[]string{"KUBECONFIG=" + e.kubeconfig})
	t.Cleanup(events.stop)

	e.kubectl(t, "-n", ns, "delete", "secret", "sale-redis")
	deleted := time.Now()
	e.kubectl(t, "delete", "namespace", ns, "--wait=false")
	e.eventuallyWithin(t, time.Until(deleted.Add(time.Minute)), "the drop is gone", func() (bool, string) {
		return e.gone(ns, obj)
	})
	e.eventuallyWithin(t, time.Until(deleted.Add(time.Minute)), "the namespace is gone", func() (bool, string) {
		return e.gone("", "namespace/"+ns)
	})

	// Why it went: the operator's log, and the Event when the API server took it.
	if line := e.operatorLogLine("cleanup skipped", ns+"/"+name); line == "" {
		t.Errorf("the operator's log (%s) has no \"cleanup skipped\" line for %s/%s", e.operator.log, ns, name)
	} else if !strings.Contains(line, pattern) {
		t.Errorf("the operator's \"cleanup skipped\" line does not name the keys %s: %s", pattern, line)
	}
	events.stop()
	if ev, found := cleanupEvent(t, events.log, name); found {
		if ev.Type != "Warning" || !strings.Contains(ev.Message, pattern) {
			t.Errorf("the CleanupSkipped Event is %s %q, want a Warning naming %s", ev.Type, ev.Message, pattern)
		}
	} else {
		t.Logf("no CleanupSkipped Event was stored (the namespace being deleted refused it); the operator's log says why the drop went")
	}

	// The keys are left to their TTLs.
	keys := strings.Fields(e.redisCLI(t, "--scan", "--pattern", pattern))
	if len(keys) == 0 {
		t.Errorf("no Redis key matches %s: a skipped cleanup leaves them to their TTLs", pattern)
	}
	for _, key := range keys {
		if ttl, _ := strconv.Atoi(strings.TrimSpace(e.redisCLI(t, "ttl", key))); ttl <= 0 {
			t.Errorf("Redis key %s was left without a TTL (%d)", key, ttl)
		}
		e.redisCLI(t, "del", key)
	}
}

// invalid_drops_rejected_at_apply: the CRD's schema and CEL rules refuse bad
// drops at `kubectl apply`, with a message naming the field; spec.redis of a
// running sale cannot change; an unknown field is refused by strict validation
// and pruned otherwise.
func invalidDropsRejectedAtApply(t *testing.T, e *env) {
	e.startOperator(t)
	ns := "e2e-invalid"
	e.ensureNamespace(t, ns)
	t.Cleanup(func() { _, _ = e.run("kubectl", "delete", "namespace", ns, "--wait=false", "--ignore-not-found") })
	u := e.redisURL
	for _, c := range []struct{ name, spec, field string }{
		{"ends-before-start", `{sku: X, limitedQuantity: 10, startsAt: "2026-12-01T12:00:00Z", endsAt: "2026-12-01T10:00:00Z", redis: {url: "` + u + `"}}`, "spec.endsAt"},
		{"ends-at-start", `{sku: X, limitedQuantity: 10, startsAt: "2026-12-01T12:00:00Z", endsAt: "2026-12-01T12:00:00Z", redis: {url: "` + u + `"}}`, "spec.endsAt"},
		{"url-and-secret", `{sku: X, limitedQuantity: 10, redis: {url: "` + u + `", secretRef: {name: sale-redis, key: url}}}`, "spec.redis"},
		{"hold-within-pending-bound", `{sku: X, limitedQuantity: 10, holdSeconds: 4, throttle: {permits: 8, acquireTimeoutMs: 2000}, redis: {url: "` + u + `"}}`, "spec.holdSeconds"},
		{"max-hold-below-hold", `{sku: X, limitedQuantity: 10, holdSeconds: 60, maxHoldSeconds: 30, redis: {url: "` + u + `"}}`, "spec.maxHoldSeconds"},
		{"max-hold-past-a-week", `{sku: X, limitedQuantity: 10, maxHoldSeconds: 604801, redis: {url: "` + u + `"}}`, "spec.maxHoldSeconds"},
		{"http-url", `{sku: X, limitedQuantity: 10, redis: {url: "http://127.0.0.1:6379"}}`, "spec.redis.url"},
		// Whoever may read drops (the sidecars' service accounts) would read it.
		{"a-password-in-the-url", `{sku: X, limitedQuantity: 10, redis: {url: "redis://default:hunter2@127.0.0.1:6379"}}`, "spec.redis"},
		{"a-password-after-an-at-sign", `{sku: X, limitedQuantity: 10, redis: {url: "redis://a@b:hunter2@127.0.0.1:6379"}}`, "spec.redis"},
		{"no-stock", `{sku: X, redis: {url: "` + u + `"}}`, "spec.limitedQuantity"},
		{"sizes-not-adding-up", `{sku: X, limitedQuantity: 10, variants: [{name: US-9, quantity: 4}, {name: US-10, quantity: 5}], redis: {url: "` + u + `"}}`, "spec.limitedQuantity"},
		{"a-size-twice", `{sku: X, variants: [{name: US-9, quantity: 4}, {name: US-9, quantity: 5}], redis: {url: "` + u + `"}}`, "spec.variants[1]"},
		{"a-size-with-a-space", `{sku: X, variants: [{name: "US 9", quantity: 4}], redis: {url: "` + u + `"}}`, "spec.variants[0].name"},
	} {
		e.refused(t, c.name, dropYAML(ns, c.name, c.spec), c.field)
		if ok, _ := e.gone(ns, "inventorydrop/"+c.name); !ok {
			t.Errorf("%s: refused, yet stored", c.name)
		}
	}
	// Sizes alone, or with the sum as limitedQuantity: accepted.
	e.kubectlIn(t, dropYAML(ns, "sizes", `{sku: X, variants: [{name: US-9, quantity: 4}, {name: US-10, quantity: 5}], redis: {url: "`+u+`"}}`),
		"apply", "--dry-run=server", "-f", "-")
	e.kubectlIn(t, dropYAML(ns, "sizes-and-sum", `{sku: X, limitedQuantity: 9, variants: [{name: US-9, quantity: 4}, {name: US-10, quantity: 5}], redis: {url: "`+u+`"}}`),
		"apply", "--dry-run=server", "-f", "-")
	// Just inside every rule: accepted.
	e.kubectlIn(t, dropYAML(ns, "just-valid", `{sku: X, limitedQuantity: 10, startsAt: "2026-12-01T10:00:00Z", endsAt: "2026-12-01T10:00:01Z", holdSeconds: 4, maxHoldSeconds: 4, throttle: {permits: 8, acquireTimeoutMs: 1999}, redis: {url: "rediss://127.0.0.1:6380"}}`),
		"apply", "--dry-run=server", "-f", "-")

	// An unknown field: kubectl apply (its default --validate=strict asks the
	// server for strict field validation) is refused, naming it; without
	// validation the server prunes it, so no drop is ever stored with it.
	unknown := dropYAML(ns, "unknown-field", `{sku: X, limitedQuantity: 10, colour: red, redis: {url: "`+u+`"}}`)
	if out, err := e.runIn(unknown, "kubectl", "apply", "-f", "-"); err == nil {
		t.Errorf("kubectl apply accepted spec.colour: %s", out)
	} else if !strings.Contains(err.Error(), `unknown field "spec.colour"`) {
		t.Errorf("kubectl apply refused spec.colour without naming it: %v", err)
	}
	pruned := e.kubectlIn(t, unknown, "apply", "--validate=ignore", "--dry-run=server", "-o", "jsonpath={.spec}", "-f", "-")
	if strings.Contains(pruned, "colour") || !strings.Contains(pruned, `"sku":"X"`) {
		t.Errorf("the API server did not prune the unknown field: spec %s", pruned)
	}

	// A running sale: spec.redis.url and secretRef are fixed, the rest may change.
	name := "running-sale"
	obj := "inventorydrop/" + name
	running := func(extra, url string) string {
		return dropYAML(ns, name, `{sku: RUN-1, limitedQuantity: 10, `+extra+`redis: {url: "`+url+`"}}`)
	}
	e.createDrop(t, ns, name, `{sku: RUN-1, limitedQuantity: 10, redis: {url: "`+u+`"}}`)
	e.waitField(t, ns, obj, "{.status.mode}", "gate")
	e.refused(t, "spec.redis of a running sale", running("", u+"/0"), "spec.redis")
	e.kubectlIn(t, running("perUserLimit: 2, ", u), "apply", "-f", "-")
	e.waitField(t, ns, obj, "{.spec.perUserLimit}", "2")
	// Where the Redis is stays fixed; whether it must be HA may change mid-sale.
	e.kubectlIn(t, dropYAML(ns, name, `{sku: RUN-1, limitedQuantity: 10, perUserLimit: 2, redis: {url: "`+u+`", requireHighAvailability: true}}`), "apply", "-f", "-")
	e.waitField(t, ns, obj, "{.spec.redis.requireHighAvailability}", "true")
	// Once it ended, spec.redis may change.
	ended := `endsAt: "2020-01-01T00:00:00Z", `
	e.kubectlIn(t, running(ended, u), "apply", "-f", "-")
	e.waitField(t, ns, obj, "{.status.phase}", "Ended")
	e.kubectlIn(t, running(ended, u+"/0"), "apply", "-f", "-")
	e.deleteDrop(t, ns, name)

	e.storedBeforeTheHoldRule(t, ns)
}

// storedBeforeTheHoldRule: a drop stored under a CRD without the hold rule (an
// upgrade) keeps selling: the API server ratchets the rule, so other changes go
// through while its hold stays as it was, the operator publishes the hold raised
// to the shortest that outlasts the pending bound, and a new short hold is
// refused.
func (e *env) storedBeforeTheHoldRule(t *testing.T, ns string) {
	const crd = "crd/inventorydrops.dropgate.io"
	const rules = "/spec/versions/0/schema/openAPIV3Schema/properties/spec/x-kubernetes-validations"
	paths := strings.Fields(e.kubectl(t, "get", crd, "-o",
		"jsonpath={.spec.versions[0].schema.openAPIV3Schema.properties.spec.x-kubernetes-validations[*].fieldPath}"))
	index := -1
	for i, path := range paths {
		if path == ".holdSeconds" {
			index = i
		}
	}
	if index < 0 {
		t.Fatalf("the CRD has no rule on .holdSeconds (rules on %v)", paths)
	}
	rule := e.kubectl(t, "get", crd, "-o", fmt.Sprintf(
		"jsonpath={.spec.versions[0].schema.openAPIV3Schema.properties.spec.x-kubernetes-validations[%d]}", index))
	at := fmt.Sprintf("%s/%d", rules, index)
	restore := func() {
		patch := fmt.Sprintf(`[{"op":"add","path":%q,"value":%s}]`, at, rule)
		if out, err := e.run("kubectl", "patch", crd, "--type=json", "-p", patch); err != nil {
			t.Fatalf("restoring the CRD's hold rule: %v: %s", err, out)
		}
	}
	e.kubectl(t, "patch", crd, "--type=json", "-p", fmt.Sprintf(`[{"op":"remove","path":%q}]`, at))
	name := "short-hold"
	short := func(extra string) string {
		return dropYAML(ns, name, `{sku: OLD-1, limitedQuantity: 10, holdSeconds: 1, `+extra+`redis: {url: "`+e.redisURL+`"}}`)
	}
	_, err := e.runIn(short(""), "kubectl", "apply", "-f", "-")
	restore()
	if err != nil {
		t.Fatalf("a short hold under the CRD without the rule: %v", err)
	}
	e.kubectl(t, "-n", ns, "wait", "--for=condition=Ready", "inventorydrop/"+name, "--timeout=120s")
	config := fmt.Sprintf("dropgate:{%s/%s}:config", ns, name)
	e.eventually(t, "the hold published raised to 3 s", func() (bool, string) {
		got := strings.TrimSpace(e.redisCLI(t, "hget", config, "holdSeconds"))
		return got == "3", got
	})
	// Another change goes through while the hold stays as stored; a new short hold
	// does not.
	e.kubectlIn(t, short("perUserLimit: 2, "), "apply", "-f", "-")
	e.waitField(t, ns, "inventorydrop/"+name, "{.spec.perUserLimit}", "2")
	refusedHold := dropYAML(ns, name, `{sku: OLD-1, limitedQuantity: 10, holdSeconds: 2, perUserLimit: 2, redis: {url: "`+e.redisURL+`"}}`)
	e.refused(t, "a new short hold", refusedHold, "spec.holdSeconds")
	e.deleteDrop(t, ns, name)
}

// ha_blip_keeps_mode: Memorystore answers 503 (a blip) to a fresh operator
// process, as after a leader change: HighlyAvailable goes Unknown, the mode stays
// gate, one Warning Event while the operator re-checks; a verified BASIC answer
// then moves the drop to fail-open.
func haBlipKeepsMode(t *testing.T, e *env) {
	const instance = "projects/e2e-project/locations/europe-west1/instances/sale-cache"
	g := startFakeGoogle(t, instance, e.redisURL)
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(g)
		}
	})
	g.set("STANDARD_HA")
	e.startOperatorWith(t, map[string]string{
		"DROPGATE_MEMORYSTORE_ENDPOINT": g.URL,
		"DROPGATE_METADATA_ENDPOINT":    g.URL,
	})
	ns, name := "e2e-ha", "ha-sale"
	obj := "inventorydrop/" + name
	e.createDrop(t, ns, name, `{sku: HA-1, limitedQuantity: 50, gate: {enabled: true, failurePolicy: Open},
    redis: {url: "`+e.redisURL+`", requireHighAvailability: true,
      memorystore: {project: e2e-project, location: europe-west1, instance: sale-cache}}}`)
	e.waitCondition(t, ns, obj, "HighlyAvailable", "True")
	e.waitField(t, ns, obj, "{.status.tier}", "STANDARD_HA")
	e.waitField(t, ns, obj, "{.status.mode}", "gate")
	uid := e.jsonpath(t, ns, obj, "{.metadata.uid}")

	// The blip, seen by a fresh process: no verdict cached.
	g.set("503")
	e.restartOperator(t)
	e.waitCondition(t, ns, obj, "HighlyAvailable", "Unknown")
	e.eventually(t, "the operator re-checks Memorystore during the blip", func() (bool, string) {
		n := g.answered("503")
		return n >= 3, g.String()
	})
	if mode := e.jsonpath(t, ns, obj, "{.status.mode}"); mode != "gate" {
		t.Errorf("an unanswered HA check changed the mode to %q", mode)
	}
	e.oneEvent(t, ns, uid, "HighAvailabilityUnknown", "Warning")

	// A verified answer: not highly available; failurePolicy Open.
	g.set("BASIC")
	e.waitField(t, ns, obj, "{.status.mode}", "fail-open")
	e.waitCondition(t, ns, obj, "HighlyAvailable", "False")
	e.oneEvent(t, ns, uid, "HighAvailabilityUnknown", "Warning")
	e.oneEvent(t, ns, uid, "FailOpenEnabled", "Warning")
	e.deleteDrop(t, ns, name)
}

// dropYAML is an InventoryDrop with spec in YAML flow style.
func dropYAML(ns, name, spec string) string {
	return fmt.Sprintf("apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {name: %s, namespace: %s}\nspec: %s\n",
		name, ns, spec)
}

// createDrop applies a drop in its own namespace (removed after the test) and
// waits until it is Ready.
func (e *env) createDrop(t *testing.T, ns, name, spec string) {
	t.Helper()
	e.ensureNamespace(t, ns)
	t.Cleanup(func() { _, _ = e.run("kubectl", "delete", "namespace", ns, "--wait=false", "--ignore-not-found") })
	e.kubectlIn(t, dropYAML(ns, name, spec), "apply", "-f", "-")
	e.kubectl(t, "-n", ns, "wait", "--for=condition=Ready", "inventorydrop/"+name, "--timeout=120s")
}

// deleteDrop deletes a drop and waits until its finalizer let it go.
func (e *env) deleteDrop(t *testing.T, ns, name string) {
	t.Helper()
	e.kubectl(t, "-n", ns, "delete", "inventorydrop/"+name, "--wait", "--timeout=120s")
}

// gone: the object does not exist (ns "" for a cluster-scoped one).
func (e *env) gone(ns, object string) (bool, string) {
	args := []string{"get", object, "-o", "jsonpath={.metadata.deletionTimestamp} {.metadata.finalizers}"}
	if ns != "" {
		args = append([]string{"-n", ns}, args...)
	}
	out, err := e.run("kubectl", args...)
	if err != nil && strings.Contains(err.Error(), "NotFound") {
		return true, ""
	}
	return false, fmt.Sprintf("still there (deletionTimestamp, finalizers: %s) %v", out, err)
}

func (e *env) dropCount(t *testing.T) int {
	t.Helper()
	return len(strings.Fields(e.kubectl(t, "get", "inventorydrops", "--all-namespaces", "-o", "name")))
}

// refused: kubectl apply of manifest fails with the API server's message naming field.
func (e *env) refused(t *testing.T, what, manifest, field string) {
	t.Helper()
	out, err := e.runIn(manifest, "kubectl", "apply", "-f", "-")
	if err == nil {
		t.Errorf("%s: kubectl apply accepted it: %s", what, out)
		return
	}
	msg := err.Error()
	if !strings.Contains(msg, "is invalid") || !strings.Contains(msg, field+":") {
		t.Errorf("%s: refused, but not with the API server's message naming %s: %v", what, field, err)
	}
	if i := strings.Index(msg, "is invalid: "); i >= 0 {
		t.Logf("%s: %s", what, strings.TrimSpace(msg[i+len("is invalid: "):]))
	}
}

// waitCondition polls a drop's condition until its status is want.
func (e *env) waitCondition(t *testing.T, ns, object, condition, want string) {
	t.Helper()
	path := fmt.Sprintf(`{.status.conditions[?(@.type=="%s")]}`, condition)
	e.eventually(t, fmt.Sprintf("%s condition %s == %s", object, condition, want), func() (bool, string) {
		out, err := e.run("kubectl", "-n", ns, "get", object, "-o", "jsonpath="+path)
		if err != nil {
			return false, err.Error()
		}
		var c struct{ Status string }
		_ = json.Unmarshal([]byte(out), &c)
		return c.Status == want, out
	})
}

// oneEvent: exactly one Event of this reason about the object, recorded once.
func (e *env) oneEvent(t *testing.T, ns, uid, reason, eventType string) {
	t.Helper()
	var list struct {
		Items []struct {
			Type    string `json:"type"`
			Message string `json:"message"`
			Count   int    `json:"count"`
			Series  *struct {
				Count int `json:"count"`
			} `json:"series"`
		} `json:"items"`
	}
	e.eventually(t, "a "+reason+" Event", func() (bool, string) {
		out, err := e.run("kubectl", "-n", ns, "get", "events", "-o", "json",
			"--field-selector", "involvedObject.uid="+uid+",reason="+reason)
		if err != nil {
			return false, err.Error()
		}
		if err := json.Unmarshal([]byte(out), &list); err != nil {
			return false, err.Error()
		}
		return len(list.Items) > 0, out
	})
	if len(list.Items) != 1 {
		t.Errorf("%d %s Events, want one: %+v", len(list.Items), reason, list.Items)
		return
	}
	ev := list.Items[0]
	if ev.Count > 1 || (ev.Series != nil && ev.Series.Count > 1) {
		t.Errorf("the %s Event was recorded more than once (count %d, series %+v): %s", reason, ev.Count, ev.Series, ev.Message)
	}
	if ev.Type != eventType {
		t.Errorf("the %s Event is of type %s, want %s", reason, ev.Type, eventType)
	}
}

type coreEvent struct {
	Type, Reason, Message string
	InvolvedObject        struct{ Name string } `json:"involvedObject"`
}

// cleanupEvent reads a `kubectl get events --watch -o json` log for the
// CleanupSkipped Event of a drop.
func cleanupEvent(t *testing.T, log, name string) (coreEvent, bool) {
	t.Helper()
	f, err := os.Open(log)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dec := json.NewDecoder(f)
	for {
		var ev coreEvent
		if err := dec.Decode(&ev); err != nil {
			return coreEvent{}, false
		}
		if ev.Reason == "CleanupSkipped" && ev.InvolvedObject.Name == name {
			return ev, true
		}
	}
}

// operatorLogLine is the first line of the suite operator's log holding every part.
func (e *env) operatorLogLine(parts ...string) string {
	if e.operator == nil {
		return ""
	}
	b, _ := os.ReadFile(e.operator.log)
	for _, line := range strings.Split(string(b), "\n") {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			return line
		}
	}
	return ""
}

// metrics are the series of an operator's /metrics: name{labels} -> value.
type metrics map[string]float64

func readMetrics(admin string) (metrics, error) {
	a, err := call("GET", "http://"+admin+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	if a.status != http.StatusOK {
		return nil, fmt.Errorf("GET /metrics: %s", a)
	}
	m := metrics{}
	for _, line := range strings.Split(a.raw, "\n") {
		i := strings.LastIndexByte(line, ' ')
		if line == "" || strings.HasPrefix(line, "#") || i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			m[line[:i]] = v
		}
	}
	return m, nil
}

func (m metrics) delta(before metrics, series string) int {
	return int(m[series] - before[series])
}

func (e *env) operatorMetrics(t *testing.T) metrics {
	t.Helper()
	m, err := readMetrics(e.operatorAdmin)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := m["dropgate_operator_reconciliations_total"]; !ok {
		t.Fatalf("the operator's /metrics has no dropgate_operator_reconciliations_total: %v", m)
	}
	return m
}

// leaseState is what the leader Lease says.
type leaseState struct {
	Holder      string `json:"holderIdentity"`
	Transitions int    `json:"leaseTransitions"`
	AcquireTime string `json:"acquireTime"`
	RenewTime   string `json:"renewTime"`
	Seconds     int    `json:"leaseDurationSeconds"`
}

func (l leaseState) String() string {
	return fmt.Sprintf("holder %q, %d transitions, acquired %s, renewed %s, %ds",
		l.Holder, l.Transitions, l.AcquireTime, l.RenewTime, l.Seconds)
}

func (e *env) lease(t *testing.T) leaseState {
	t.Helper()
	var l leaseState
	out := e.kubectl(t, "-n", operatorNS, "get", "lease", leaseName, "-o", "jsonpath={.spec}")
	if err := json.Unmarshal([]byte(out), &l); err != nil {
		t.Fatalf("lease %s: %v: %s", leaseName, err, out)
	}
	return l
}

// replica is one more `dropgate-operator run` process, sharing the suite's
// Lease, with its own line to the API server.
type replica struct {
	id    string
	lease time.Duration
	proc  *process
	admin string
	line  *apiLine
}

func (r *replica) retryPeriod() time.Duration { return r.lease * 2 / 15 }

func (e *env) startReplica(t *testing.T, id string, leaseSeconds int) *replica {
	t.Helper()
	r := &replica{id: id, lease: time.Duration(leaseSeconds) * time.Second,
		admin: fmt.Sprintf("127.0.0.1:%d", freePort(t))}
	settings := e.operatorSettings(t, map[string]string{"POD_NAME": id, "DROPGATE_LEASE_SECONDS": strconv.Itoa(leaseSeconds)})
	r.line, settings["KUBECONFIG"] = e.lineToAPIServer(t, id)
	r.proc = e.startOperatorProcess(t, id, settings, r.admin)
	t.Cleanup(r.proc.stop)
	e.eventually(t, id+" serves /metrics", func() (bool, string) {
		if r.proc.exited() {
			t.Fatalf("%s exited: %v (see %s)", id, r.proc.err, r.proc.log)
		}
		_, err := readMetrics(r.admin)
		return err == nil, fmt.Sprint(err)
	})
	return r
}

func (r *replica) metric(t *testing.T, series string) float64 {
	t.Helper()
	if r.proc.exited() {
		t.Fatalf("%s exited: %v (see %s)", r.id, r.proc.err, r.proc.log)
	}
	m, err := readMetrics(r.admin)
	if err != nil {
		t.Fatalf("%s: %v", r.id, err)
	}
	return m[series]
}

// leads: the replica says it leads, and the Lease names it.
func (e *env) leads(r *replica) (bool, string) {
	m, err := readMetrics(r.admin)
	if err != nil {
		return false, err.Error()
	}
	holder, err := e.run("kubectl", "-n", operatorNS, "get", "lease", leaseName, "-o", "jsonpath={.spec.holderIdentity}")
	return m["dropgate_operator_leader"] == 1 && holder == r.id,
		fmt.Sprintf("%s: leader %v; the Lease's holder %q %v", r.id, m["dropgate_operator_leader"], holder, err)
}

// onlyOneActs: the leader leads and reconciles (its count grows over a resync);
// the follower does not lead and has never reconciled.
func (e *env) onlyOneActs(t *testing.T, leader, follower *replica) {
	t.Helper()
	e.eventually(t, leader.id+" leads", func() (bool, string) { return e.leads(leader) })
	start := leader.metric(t, "dropgate_operator_reconciliations_total")
	e.eventually(t, leader.id+" reconciles", func() (bool, string) {
		n := leader.metric(t, "dropgate_operator_reconciliations_total")
		return n > start, fmt.Sprintf("%v reconciles", n)
	})
	if ok, seen := e.leads(leader); !ok {
		t.Errorf("%s stopped leading with %s beside it: %s", leader.id, follower.id, seen)
	}
	if got := follower.metric(t, "dropgate_operator_leader"); got != 0 {
		t.Errorf("%s and %s both say they lead", leader.id, follower.id)
	}
	if got := follower.metric(t, "dropgate_operator_reconciliations_total"); got != 0 {
		t.Errorf("the follower %s reconciled %v times while %s led", follower.id, got, leader.id)
	}
}

// apiLine forwards TCP connections to the API server until it is cut: the
// process behind it then reaches the API server no more.
type apiLine struct {
	listener net.Listener
	mu       sync.Mutex
	conns    []net.Conn
	isCut    bool
}

// lineToAPIServer opens an apiLine and writes a kubeconfig (the operator's
// ServiceAccount) that goes through it.
func (e *env) lineToAPIServer(t *testing.T, name string) (*apiLine, string) {
	t.Helper()
	server := e.kubectl(t, "config", "view", "--minify", "-o", "jsonpath={.clusters[0].cluster.server}")
	target, err := url.Parse(server)
	if err != nil {
		t.Fatal(err)
	}
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := &apiLine{listener: listener}
	t.Cleanup(l.cut)
	go func() {
		for {
			down, err := listener.Accept()
			if err != nil {
				return
			}
			up, err := net.DialTimeout("tcp", target.Host, 5*time.Second)
			if err != nil {
				down.Close()
				continue
			}
			if l.track(down, up) {
				go pipe(down, up)
				go pipe(up, down)
			}
		}
	}()
	config, err := os.ReadFile(e.saConfig)
	if err != nil {
		t.Fatal(err)
	}
	through := strings.Replace(string(config), strconv.Quote(server),
		strconv.Quote("https://"+listener.Addr().String()), 1)
	if through == string(config) {
		t.Fatalf("%s does not name the API server %s", e.saConfig, server)
	}
	path := filepath.Join(e.work, name+".kubeconfig")
	if err := os.WriteFile(path, []byte(through), 0o600); err != nil {
		t.Fatal(err)
	}
	return l, path
}

func (l *apiLine) track(conns ...net.Conn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.isCut {
		for _, c := range conns {
			c.Close()
		}
		return false
	}
	l.conns = append(l.conns, conns...)
	return true
}

// cut closes the line and every connection through it.
func (l *apiLine) cut() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.isCut = true
	l.listener.Close()
	for _, c := range l.conns {
		c.Close()
	}
}

func pipe(to, from net.Conn) {
	_, _ = io.Copy(to, from)
	to.Close()
	from.Close()
}

// handedOver: the Lease changed holder once more, with a new acquireTime.
func (e *env) handedOver(t *testing.T, before leaseState, to *replica) {
	t.Helper()
	after := e.lease(t)
	if after.Holder != to.id || after.Transitions != before.Transitions+1 ||
		after.AcquireTime == "" || after.AcquireTime == before.AcquireTime {
		t.Errorf("the Lease after %s took over: %s; before: %s (want one more transition and a new acquireTime)",
			to.id, after, before)
	}
}

// kill ends a process with SIGKILL: nothing runs on its way out.
func (p *process) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// terminate sends SIGTERM; the process must exit, successfully, within limit.
func (p *process) terminate(t *testing.T, limit time.Duration) {
	t.Helper()
	sent := time.Now()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		if p.err != nil {
			t.Errorf("%s exited on SIGTERM with %v (see %s)", p.name, p.err, p.log)
		}
	case <-time.After(limit):
		t.Errorf("%s did not exit within %s of SIGTERM (see %s)", p.name, limit, p.log)
		p.kill()
	}
	t.Logf("%s exited %s after SIGTERM", p.name, time.Since(sent).Round(time.Millisecond))
}

// fakeGoogle plays the GCE metadata server and the Memorystore API for one
// instance, whose answer a scenario switches: a tier (STANDARD_HA, BASIC) or a
// status code (503). Like Google, it wants Metadata-Flavor: Google for the token
// and that token for the API.
type fakeGoogle struct {
	*httptest.Server
	mu       sync.Mutex
	answer   string
	answers  map[string]int
	refusals []string
}

const fakeToken = "ya29.e2e-token"

func startFakeGoogle(t *testing.T, instance, redisURL string) *fakeGoogle {
	t.Helper()
	u, err := url.Parse(redisURL)
	if err != nil {
		t.Fatal(err)
	}
	port, _ := strconv.Atoi(u.Port())
	g := &fakeGoogle{answers: map[string]int{}}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /computeMetadata/v1/instance/service-accounts/default/token", func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Metadata-Flavor") != "Google" {
			g.refuse(w, r, http.StatusForbidden)
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"access_token": fakeToken, "expires_in": 3599, "token_type": "Bearer"})
	})
	mux.HandleFunc("GET /v1/"+instance, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+fakeToken {
			g.refuse(w, r, http.StatusUnauthorized)
			return
		}
		g.mu.Lock()
		answer := g.answer
		g.answers[answer]++
		g.mu.Unlock()
		if code, err := strconv.Atoi(answer); err == nil {
			writeJSON(w, code, map[string]any{"error": map[string]any{
				"code": code, "message": http.StatusText(code), "status": "UNAVAILABLE"}})
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"name": instance, "tier": answer, "state": "READY",
			"host": u.Hostname(), "port": port, "memorySizeGb": 1, "redisVersion": "REDIS_7_2"})
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { g.refuse(w, r, http.StatusNotFound) })
	g.Server = httptest.NewServer(mux)
	t.Cleanup(g.Close)
	return g
}

func (g *fakeGoogle) set(answer string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.answer = answer
}

// answered: how many instance requests got this answer.
func (g *fakeGoogle) answered(answer string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.answers[answer]
}

func (g *fakeGoogle) refuse(w http.ResponseWriter, r *http.Request, code int) {
	g.mu.Lock()
	g.refusals = append(g.refusals, fmt.Sprintf("%s %s -> %d", r.Method, r.URL.Path, code))
	g.mu.Unlock()
	http.Error(w, http.StatusText(code), code)
}

func (g *fakeGoogle) String() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return fmt.Sprintf("fake Memorystore answers %v, refused %v", g.answers, g.refusals)
}

func writeJSON(w http.ResponseWriter, code int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(body)
}
