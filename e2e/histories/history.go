package histories

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/anishathalye/porcupine"
)

// world is one history being recorded: its drop, database, sidecars and clients.
type world struct {
	lab        *lab
	seed       int64
	cfg        histConfig
	drop       string
	uid        string
	db         string
	sqlitePath string
	dir        string
	sidecars   []*sidecar
	rec        *recorder
	keys       *keyPool
	pace       atomic.Int64 // the clients' mean pause between calls (ns)
	base       time.Time    // the window's instants are counted from it

	// The manifest as last applied.
	limit    int
	variants []int // each variant's quantity (a drop with variants)
	ended    bool
	gateOn   bool

	mu     sync.Mutex
	events []string

	setupTook, runTook, auditTook time.Duration // how long each phase took
	ledger                        string        // the ledger's rows at the end: key|user|quantity|state|path
}

func (w *world) event(format string, args ...any) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.events = append(w.events, fmt.Sprintf("%8.3fs  %s", float64(w.rec.now())/1e9, fmt.Sprintf(format, args...)))
}

func (w *world) manifest() string {
	// Two fixed instants, so that re-applying the same intent changes nothing.
	ends := w.base.Add(24 * time.Hour)
	if w.ended {
		ends = w.base.Add(-time.Minute)
	}
	stock := fmt.Sprintf("limitedQuantity: %d", w.limit)
	if len(w.variants) > 0 {
		var sizes []string
		for i, q := range w.variants {
			sizes = append(sizes, fmt.Sprintf("{name: %s, quantity: %d}", variantName(i), q))
		}
		stock = "variants: [" + strings.Join(sizes, ", ") + "]"
	}
	return fmt.Sprintf(`apiVersion: dropgate.io/v1alpha1
kind: InventoryDrop
metadata: {name: %s, namespace: shop, uid: %s}
spec:
  sku: SKU-%s
  %s
  perUserLimit: %d
  holdSeconds: 3600
  endsAt: %q
  redis: {url: "redis://unused:1", requireHighAvailability: false}
  gate: {enabled: %t, failurePolicy: Open}
  throttle: {permits: %d, acquireTimeoutMs: %d}
`, w.drop, w.uid, w.drop, stock, w.cfg.PerUser, ends.UTC().Format(time.RFC3339), w.gateOn, w.cfg.Permits, w.cfg.AcquireMs)
}

// applyChange changes the manifest, runs apply until it succeeds (as the
// operator's reconcile retries) and records it as one operation over all its
// attempts.
func (w *world) applyChange(ch applyChange) {
	switch ch.What {
	case "limit":
		if ch.Variant >= 0 {
			w.variants[ch.Variant] = ch.Limit
			w.limit = 0
			for _, q := range w.variants {
				w.limit += q
			}
		} else {
			w.limit = ch.Limit
		}
	case "ends":
		w.ended = ch.Ended
	case "gate":
		w.gateOn = ch.Gate
	}
	c := &call{Kind: kApply, Client: 2 * w.cfg.Clients, Sidecar: -1, Apply: ch}
	c.Invoke = w.rec.now()
	deadline := time.Now().Add(20 * time.Second)
	var err error
	for {
		err = w.lab.apply(w.manifest())
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	c.Return = w.rec.now()
	c.Ans = answer{Kind: ansDefinite, Remaining: -1}
	if err != nil {
		c.Ans = answer{Kind: ansUnknown, Err: err.Error(), Remaining: -1}
		w.event("apply %s failed for 20s: %v", ch.What, err)
	} else {
		w.event("applied %s", describeChange(ch))
	}
	w.rec.add(c)
}

func describeChange(ch applyChange) string {
	switch ch.What {
	case "limit":
		if ch.Variant >= 0 {
			return fmt.Sprintf("variant %s quantity=%d", variantName(ch.Variant), ch.Limit)
		}
		return fmt.Sprintf("limitedQuantity=%d", ch.Limit)
	case "ends":
		if ch.Ended {
			return "endsAt in the past"
		}
		return "endsAt in the future"
	case "gate":
		return fmt.Sprintf("gate.enabled=%t", ch.Gate)
	}
	return ch.What
}

// outcome is a recorded and checked history.
type outcome struct {
	cfg      histConfig
	calls    []*call
	ops      int
	result   porcupine.CheckResult
	took     time.Duration
	checked  time.Duration
	report   string // for a failure: what the checker found
	artifact string // the visualization's path
	err      error  // the harness itself failed (not a verdict)
	phases   string
	witness  []*call  // the reads of the smallest failing history
	badKeys  []string // keys whose own history is not linearizable
	// withoutShows: the verdict without the drop's GET answers.
	withoutShows porcupine.CheckResult
}

// runHistory records the history cfg names on the lab and checks it.
func runHistory(l *lab, cfg histConfig, artifacts string, checkTimeout, diagnose time.Duration) *outcome {
	started := time.Now()
	o := &outcome{cfg: cfg}
	dir, err := os.MkdirTemp(l.dir, fmt.Sprintf("h%d-", cfg.Seed))
	if err != nil {
		o.err = err
		return o
	}
	defer os.RemoveAll(dir)
	w := &world{
		lab:    l,
		seed:   cfg.Seed,
		cfg:    cfg,
		drop:   fmt.Sprintf("h%d-%d", cfg.Seed, time.Now().UnixNano()%1_000_000),
		uid:    fmt.Sprintf("uid-%d-%d", cfg.Seed, time.Now().UnixNano()),
		db:     fmt.Sprintf("h%d", cfg.Seed),
		dir:    dir,
		rec:    &recorder{start: time.Now()},
		base:   time.Now().Truncate(time.Second),
		keys:   &keyPool{},
		limit:  cfg.Limit,
		gateOn: true,
	}
	if err := w.record(); err != nil {
		o.err = err
		o.report = w.describe("")
		saveText(artifacts, cfg.Seed, "harness error: "+err.Error()+"\n\n"+o.report, dir)
		return o
	}
	o.took = time.Since(started)
	o.phases = fmt.Sprintf("setup %s, clients %s, audit %s", w.setupTook.Round(time.Millisecond), w.runTook.Round(time.Millisecond), w.auditTook.Round(time.Millisecond))
	o.calls = w.rec.calls
	reading := check(o, w.rec.calls, cfg, artifacts, checkTimeout, diagnose)
	if o.result == porcupine.Ok && os.Getenv("DROPGATE_HISTORY_REPORTS") == "1" {
		saveText(artifacts, cfg.Seed, w.describe("verdict: linearizable\n"+summary(w.rec.calls)), dir)
	}
	if o.result != porcupine.Ok {
		o.report = w.describe(reading + ledgerReading(w.ledger, w.rec.calls) + summary(w.rec.calls))
		saveText(artifacts, cfg.Seed, o.report, dir)
		saveCalls(artifacts, cfg, w.rec.calls)
	}
	return o
}

// check decides whether calls are linearizable, fills o's verdict and, for a
// failure, writes the visualizations and returns the reading. Fast proofs first:
// an answer the model never allows, then each key's own history (small
// projections the checker refutes in milliseconds); the whole history only when
// neither proves anything, and then the smallest failing history is searched for.
func check(o *outcome, calls []*call, cfg histConfig, artifacts string, timeout, diagnose time.Duration) string {
	sp, ops := translate(calls, cfg.Limit, cfg.Variants, cfg.PerUser, false, cfg.Clients)
	o.ops = len(ops)
	model := sp.model()
	checkStart := time.Now()
	defer func() { o.checked = time.Since(checkStart) }()
	var reading strings.Builder
	var impossibles []*call
	for _, c := range calls {
		if impossible(c) {
			impossibles = append(impossibles, c)
		}
	}
	o.badKeys = illegalKeys(calls, cfg.Clients)
	var info porcupine.LinearizationInfo
	if len(impossibles) > 0 || len(o.badKeys) > 0 {
		// Proven already; the whole history's search only feeds the
		// visualization, so it gets less time.
		o.result = porcupine.Illegal
		_, info = porcupine.CheckOperationsVerbose(model, ops, diagnose)
		reading.WriteString("verdict: NOT LINEARIZABLE\n")
	} else {
		o.result, info = porcupine.CheckOperationsVerbose(model, ops, timeout)
		if o.result == porcupine.Ok {
			return ""
		}
		reading.WriteString(explain(sp, model, ops, info, o.result))
	}
	_ = os.MkdirAll(artifacts, 0o755)
	smallest := filepath.Join(artifacts, fmt.Sprintf("history-%d-smallest.html", cfg.Seed))
	if len(impossibles) > 0 {
		fmt.Fprintf(&reading, "answers the model allows in no state (%d):\n", len(impossibles))
		for i, c := range impossibles {
			if i == 10 {
				break
			}
			fmt.Fprintf(&reading, "  %s\n", c)
		}
	}
	if len(o.badKeys) > 0 {
		shown := o.badKeys
		if len(shown) > 5 {
			shown = shown[:5]
		}
		fmt.Fprintf(&reading, "keys whose own history is not linearizable (%d): %s\n%s", len(o.badKeys), strings.Join(o.badKeys, " "), describeKeyCalls(calls, shown))
		// The smallest failing history: the first such key's own.
		ksp, kops := translate(keyProjection(calls, o.badKeys[0]), 1<<20, nil, 1<<20, false, cfg.Clients)
		kmodel := ksp.model()
		if _, kinfo := porcupine.CheckOperationsVerbose(kmodel, kops, diagnose); porcupine.VisualizePath(kmodel, kinfo, smallest) == nil {
			o.artifact = smallest + " (key " + o.badKeys[0] + "'s own history; the whole history: "
		}
	} else {
		reading.WriteString("every key's own history is linearizable: the violation is about the stock or the buyers' counts\n")
		var noShow []porcupine.Operation
		for _, op := range ops {
			if op.Input.(mIn).op != opShow {
				noShow = append(noShow, op)
			}
		}
		if len(noShow) < len(ops) {
			o.withoutShows = porcupine.CheckOperationsTimeout(model, noShow, diagnose)
			fmt.Fprintf(&reading, "without the drop's GET answers the history is: %s\n", o.withoutShows)
		}
		if o.result == porcupine.Illegal {
			// The earliest moment the history is already illegal, and of that
			// truncation every write and only the reads that no order of them
			// explains.
			small, csp, cmodel := ops, sp, model
			at, cut := firstIllegal(calls, cfg, time.Now().Add(diagnose))
			if at >= 0 {
				var last *call
				for _, c := range calls {
					if c.Return == at && c.Ans.Kind != ansUnknown {
						last = c
					}
				}
				fmt.Fprintf(&reading, "already not linearizable by %.3fs (%d of %d calls), when this returned: %s\n", float64(at)/1e9, len(cut), len(calls), last)
				csp, small = translate(cut, cfg.Limit, cfg.Variants, cfg.PerUser, false, cfg.Clients)
				cmodel = csp.model()
			}
			small = minimize(cmodel, small, diagnose)
			for _, op := range small {
				if pureRead(op) {
					o.witness = append(o.witness, op.Input.(mIn).rec)
				}
			}
			reading.WriteString(witness(csp, small, calls))
			_, smallInfo := porcupine.CheckOperationsVerbose(cmodel, small, diagnose)
			if porcupine.VisualizePath(cmodel, smallInfo, smallest) == nil {
				o.artifact = smallest + " (the whole history: "
			}
		}
	}
	full := filepath.Join(artifacts, fmt.Sprintf("history-%d.html", cfg.Seed))
	if err := porcupine.VisualizePath(model, info, full); err != nil {
		full = "(visualization failed: " + err.Error() + ")"
	}
	if o.artifact != "" {
		o.artifact += full + ")"
	} else {
		o.artifact = full
	}
	return reading.String()
}

// record runs the sale: sidecars up, the drop applied, clients and the fault
// schedule, then the audit.
func (w *world) record() error {
	l := w.lab
	began := time.Now()
	if err := l.reset(); err != nil {
		return fmt.Errorf("lab reset: %w", err)
	}
	databaseURL := ""
	if w.cfg.SQLite {
		w.sqlitePath = filepath.Join(w.dir, "ledger.db")
		databaseURL = "sqlite://" + w.sqlitePath
	} else {
		if err := l.pg.createDatabase(w.db); err != nil {
			return err
		}
		defer l.pg.dropDatabase(w.db)
		databaseURL = l.pg.url(w.db)
	}
	var env []string
	if w.cfg.Bug != "" {
		env = append(env, "DROPGATE_FAULTS="+w.cfg.Bug)
	}
	for i := 0; i < w.cfg.Sidecars; i++ {
		sc, err := newSidecar(l.binDir, i, l.proxies[i], databaseURL, w.dir, env)
		if err != nil {
			return err
		}
		w.sidecars = append(w.sidecars, sc)
	}
	defer func() {
		for _, sc := range w.sidecars {
			sc.stop()
		}
	}()
	w.limit, w.ended, w.gateOn = w.cfg.Limit, false, true
	w.variants = append([]int(nil), w.cfg.Variants...)
	if err := l.apply(w.manifest()); err != nil {
		return err
	}
	for _, sc := range w.sidecars {
		if err := sc.start(); err != nil {
			return err
		}
	}
	w.rec.start = time.Now()
	w.setupTook = time.Since(began)
	w.event("clients start (%s UTC, as the sidecars' logs count time)", w.rec.start.UTC().Format("15:04:05.000"))
	d := w.cfg.duration() + 500*time.Millisecond
	w.pace.Store(int64(max(2*time.Millisecond, min(60*time.Millisecond, time.Duration(int64(d)*int64(w.cfg.Clients)/int64(w.cfg.MinOps+200))))))
	stop := make(chan struct{})
	var clients sync.WaitGroup
	for id := 0; id < w.cfg.Clients; id++ {
		clients.Add(1)
		go w.client(id, stop, &clients)
	}
	var faultErr error
	time.Sleep(300 * time.Millisecond)
	for _, f := range w.cfg.Faults {
		time.Sleep(f.Gap)
		if faultErr = w.inject(f); faultErr != nil {
			break
		}
	}
	// Every sidecar up again (a fault that failed half-way may have left one down).
	for _, sc := range w.sidecars {
		if _, _, up := sc.state(); !up {
			if err := sc.start(); err != nil && faultErr == nil {
				faultErr = err
			}
		}
	}
	// The schedule is over: the operations still missing come as fast as the
	// clients can send them.
	w.pace.Store(int64(time.Millisecond))
	deadline := time.Now().Add(30 * time.Second)
	for w.rec.count() < w.cfg.MinOps && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond)
	close(stop)
	clients.Wait()
	w.event("clients stop")
	if faultErr != nil {
		return fmt.Errorf("fault schedule: %w", faultErr)
	}
	w.runTook = time.Since(w.rec.start)
	w.audit()
	w.auditTook = time.Since(w.rec.start) - w.runTook
	w.event("audit done")
	w.ledger = w.dumpLedger()
	return nil
}

// describe is a history's report: configuration, schedule, what happened when,
// the checker's reading and every call.
func (w *world) describe(reading string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s\nschedule:\n%s\n\nevents:\n", w.cfg, w.cfg.schedule())
	w.mu.Lock()
	for _, e := range w.events {
		fmt.Fprintf(&b, "  %s\n", e)
	}
	w.mu.Unlock()
	if reading != "" {
		fmt.Fprintf(&b, "\n%s\n", reading)
	}
	fmt.Fprintf(&b, "\nreplay: DROPGATE_SEED=%d scripts/histories -run 'TestHistories$'\n\ncalls (%d):\n", w.cfg.Seed, len(w.rec.calls))
	calls := append([]*call(nil), w.rec.calls...)
	sort.SliceStable(calls, func(i, j int) bool { return calls[i].Invoke < calls[j].Invoke })
	for _, c := range calls {
		fmt.Fprintf(&b, "  %s\n", c)
	}
	return b.String()
}

// saveText writes the report and the sidecars' logs next to the visualization.
func saveText(artifacts string, seed int64, text, dir string) {
	if err := os.MkdirAll(artifacts, 0o755); err != nil {
		return
	}
	_ = os.WriteFile(filepath.Join(artifacts, fmt.Sprintf("history-%d.txt", seed)), []byte(text), 0o644)
	logs, _ := filepath.Glob(filepath.Join(dir, "sidecar*.log"))
	for _, p := range logs {
		if raw, err := os.ReadFile(p); err == nil {
			_ = os.WriteFile(filepath.Join(artifacts, fmt.Sprintf("history-%d-%s", seed, filepath.Base(p))), raw, 0o644)
		}
	}
}

// explain reads a failed check: the longest linearizable prefix, the state it
// leaves, and the operations that cannot follow it.
func explain(sp *spec, model porcupine.Model, ops []porcupine.Operation, info porcupine.LinearizationInfo, result porcupine.CheckResult) string {
	var b strings.Builder
	if result == porcupine.Unknown {
		b.WriteString("verdict: UNKNOWN (the checker timed out before deciding)\n")
	} else {
		b.WriteString("verdict: NOT LINEARIZABLE\n")
	}
	partials := info.PartialLinearizations()
	if len(partials) == 0 || len(partials[0]) == 0 {
		return b.String()
	}
	longest := partials[0][0]
	for _, p := range partials[0] {
		if len(p) > len(longest) {
			longest = p
		}
	}
	state := model.Init()
	in := map[int]bool{}
	for _, id := range longest {
		_, state = model.Step(state, ops[id].Input, ops[id].Output)
		in[id] = true
	}
	s := state.(mState)
	fmt.Fprintf(&b, "longest linearizable prefix: %d of %d operations; the model after it: %s\n", len(longest), len(ops), sp.describeState(s))
	if len(longest) > 0 {
		last := longest[len(longest)-1]
		fmt.Fprintf(&b, "  its last step: %s\n", sp.describe(ops[last].Input.(mIn), ops[last].Output.(mOut)))
	}
	// The operations left out that returned first: one of them is what no order
	// can explain.
	var left []int
	for id := range ops {
		if !in[id] {
			left = append(left, id)
		}
	}
	sort.Slice(left, func(i, j int) bool { return ops[left[i]].Return < ops[left[j]].Return })
	b.WriteString("operations that cannot follow it (earliest return first):\n")
	var keys []int
	for i, id := range left {
		if i == 6 {
			break
		}
		op := ops[id]
		mi := op.Input.(mIn)
		keys = append(keys, mi.key)
		ok, _ := model.Step(state, op.Input, op.Output)
		verdict := "allowed here"
		if !ok {
			verdict = "refused by the model here"
		}
		fmt.Fprintf(&b, "  [%.3fs..%s] %s (%s)\n", float64(op.Call)/1e9, retString(op.Return), sp.describe(mi, op.Output.(mOut)), verdict)
	}
	if d := sp.describeKeys(s, keys); d != "" {
		fmt.Fprintf(&b, "those keys in the model: %s\n", d)
	}
	return b.String()
}

func retString(r int64) string {
	if r >= unbounded {
		return "∞"
	}
	return fmt.Sprintf("%.3fs", float64(r)/1e9)
}

// summary counts the answers of each kind of call.
func summary(calls []*call) string {
	counts := map[string]int{}
	for _, c := range calls {
		word := c.Ans.Outcome
		switch {
		case c.Kind == kApply:
			word = "ok"
			if c.Ans.Kind == ansUnknown {
				word = "failed"
			}
		case c.Ans.Kind == ansUnknown:
			word = "no-answer"
		}
		if c.Ans.Path == "fallback" {
			word += "(fallback)"
		}
		counts[kindNames[c.Kind]+" "+word]++
	}
	names := make([]string, 0, len(counts))
	for n := range counts {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	b.WriteString("answers:")
	for _, n := range names {
		fmt.Fprintf(&b, " %s=%d", n, counts[n])
	}
	return b.String() + "\n"
}

// minimize leaves out as many pure reads as it can while the history stays
// illegal: what is left is every write and the few observations that no order
// of them explains.
func minimize(model porcupine.Model, ops []porcupine.Operation, budget time.Duration) []porcupine.Operation {
	deadline := time.Now().Add(budget)
	keep := make([]bool, len(ops))
	var reads []int
	for i, op := range ops {
		keep[i] = !pureRead(op)
		if !keep[i] {
			reads = append(reads, i)
		}
	}
	illegal := func(without map[int]bool, current []int) bool {
		var h []porcupine.Operation
		for i, op := range ops {
			if keep[i] {
				h = append(h, op)
			}
		}
		for _, i := range current {
			if !without[i] {
				h = append(h, ops[i])
			}
		}
		return porcupine.CheckOperationsTimeout(model, h, 2*time.Second) == porcupine.Illegal
	}
	// ddmin over the reads: drop chunks while the rest stays illegal.
	current := reads
	chunk := (len(current) + 1) / 2
	for chunk >= 1 && time.Now().Before(deadline) {
		removed := false
		for start := 0; start < len(current) && time.Now().Before(deadline); start += chunk {
			end := min(start+chunk, len(current))
			without := map[int]bool{}
			for _, i := range current[start:end] {
				without[i] = true
			}
			if illegal(without, current) {
				current = append(append([]int(nil), current[:start]...), current[end:]...)
				removed = true
				start -= chunk
			}
		}
		if !removed {
			if chunk == 1 {
				break
			}
			chunk = (chunk + 1) / 2
		}
	}
	for _, i := range current {
		keep[i] = true
	}
	var h []porcupine.Operation
	for i, op := range ops {
		if keep[i] {
			h = append(h, op)
		}
	}
	return h
}

// witness describes a minimized failing history: its reads, every recorded call
// on the keys they name, and for a read of the stock the calls around it.
func witness(sp *spec, small []porcupine.Operation, calls []*call) string {
	var b strings.Builder
	keys := map[string]bool{}
	var reads []porcupine.Operation
	for _, op := range small {
		if pureRead(op) {
			reads = append(reads, op)
		}
	}
	fmt.Fprintf(&b, "smallest failing history: every write and %d reads that no order of the writes explains:\n", len(reads))
	var stockReads []porcupine.Operation
	for _, op := range reads {
		in := op.Input.(mIn)
		fmt.Fprintf(&b, "  [%.3fs..%s] %s\n", float64(op.Call)/1e9, retString(op.Return), sp.describe(in, op.Output.(mOut)))
		if in.key >= 0 {
			keys[sp.keys[in.key]] = true
		}
		if in.op == opShow || in.op == opReserve {
			stockReads = append(stockReads, op)
		}
	}
	sorted := append([]*call(nil), calls...)
	sort.SliceStable(sorted, func(i, j int) bool { return sorted[i].Invoke < sorted[j].Invoke })
	if len(keys) > 0 {
		b.WriteString("every call on those keys:\n")
		for _, c := range sorted {
			if keys[c.Key] {
				fmt.Fprintf(&b, "  %s\n", c)
			}
		}
	}
	for _, op := range stockReads {
		fmt.Fprintf(&b, "the calls that change the stock or answer 503 around the read at %.3fs:\n", float64(op.Call)/1e9)
		for _, c := range sorted {
			near := c.Invoke <= op.Return+100e6 && c.Return >= op.Call-300e6
			changes := c.Kind == kApply || c.Ans.Kind != ansDefinite ||
				c.Ans.Outcome == "admitted" || (c.Kind == kCancel && c.Ans.Outcome == "cancelled")
			if near && changes {
				fmt.Fprintf(&b, "  %s\n", c)
			}
		}
	}
	return b.String()
}

// saved is a recorded history as history-N.json keeps it, for checking it again
// without recording it again (DROPGATE_RECHECK).
type saved struct {
	Config histConfig
	Calls  []*call
}

func saveCalls(artifacts string, cfg histConfig, calls []*call) {
	raw, err := json.Marshal(saved{Config: cfg, Calls: calls})
	if err == nil {
		_ = os.WriteFile(filepath.Join(artifacts, fmt.Sprintf("history-%d.json", cfg.Seed)), raw, 0o644)
	}
}

func loadCalls(path string) (*saved, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var s saved
	return &s, json.Unmarshal(raw, &s)
}

// keyProjection is the part of a history that is about key alone: its calls,
// without the answers that depend on other keys (per_user_limit_exceeded,
// sold_out), with the window's changes, checked against a model whose stock and
// buyer limits never refuse. Every linearization of the whole history, cut down
// to these calls, is one of the projection, so a projection that is not
// linearizable proves the whole history is not, and names the key it is about.
func keyProjection(calls []*call, key string) []*call {
	var sub []*call
	for _, c := range calls {
		switch {
		case c.Kind == kApply && c.Apply.What == "ends":
			sub = append(sub, c)
		case c.Key == key && c.Kind != kShow:
			if c.Kind == kReserve && (c.Ans.Outcome == "per_user_limit_exceeded" || c.Ans.Outcome == "sold_out") {
				continue
			}
			sub = append(sub, c)
		}
	}
	return sub
}

// illegalKeys are the keys whose projection is not linearizable (as many as 15 s
// allow).
func illegalKeys(calls []*call, clients int) []string {
	seen := map[string]bool{}
	var keys []string
	for _, c := range calls {
		if c.Key != "" && !seen[c.Key] {
			seen[c.Key] = true
			keys = append(keys, c.Key)
		}
	}
	var bad []string
	deadline := time.Now().Add(15 * time.Second)
	for _, k := range keys {
		if time.Now().After(deadline) {
			break
		}
		sub := keyProjection(calls, k)
		sp, ops := translate(sub, 1<<20, nil, 1<<20, false, clients)
		if porcupine.CheckOperationsTimeout(sp.model(), ops, 2*time.Second) == porcupine.Illegal {
			bad = append(bad, k)
		}
	}
	return bad
}

// describeKeyCalls lists every call on the given keys.
func describeKeyCalls(calls []*call, keys []string) string {
	var b strings.Builder
	sorted := append([]*call(nil), calls...)
	sort.SliceStable(sorted, func(i, j int) bool { return sorted[i].Invoke < sorted[j].Invoke })
	for _, k := range keys {
		fmt.Fprintf(&b, "key %s:\n", k)
		for _, c := range sorted {
			if c.Key == k {
				fmt.Fprintf(&b, "  %s\n", c)
			}
		}
	}
	return b.String()
}

// ledgerQuery reads what the ledger holds at the end of a history.
const ledgerQuery = "SELECT 'stock', lim, available, '', '' FROM stock; " +
	"SELECT res_key, user_id, quantity, state, path FROM reservations ORDER BY res_key"

func (w *world) dumpLedger() string {
	if w.cfg.SQLite {
		out, err := exec.Command(sqlite3Bin, "-separator", "|", w.sqlitePath, ledgerQuery).CombinedOutput()
		if err != nil {
			return "(the ledger could not be read: " + err.Error() + ")"
		}
		return string(out)
	}
	out, err := w.lab.pg.query(w.db, ledgerQuery)
	if err != nil {
		return "(the ledger could not be read: " + err.Error() + ")"
	}
	return out
}

// ledgerReading compares the ledger's rows at the end with what the clients were
// last told about each key.
func ledgerReading(dump string, calls []*call) string {
	sorted := append([]*call(nil), calls...)
	sort.SliceStable(sorted, func(i, j int) bool { return sorted[i].Return < sorted[j].Return })
	told := map[string]string{}
	for _, c := range sorted {
		if c.Key == "" || c.Ans.Kind != ansDefinite {
			continue
		}
		switch {
		case c.Ans.Outcome == "not_found":
			told[c.Key] = "none"
		case c.Ans.State != "" && c.Ans.Outcome != "idempotency_key_reused":
			told[c.Key] = c.Ans.State
		}
	}
	var b strings.Builder
	held := 0
	rows := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(dump), "\n") {
		f := strings.Split(line, "|")
		if len(f) < 5 {
			if strings.TrimSpace(line) != "" {
				fmt.Fprintf(&b, "  %s\n", line)
			}
			continue
		}
		if f[0] == "stock" {
			fmt.Fprintf(&b, "  the ledger's stock row: limit %s, available %s\n", f[1], f[2])
			continue
		}
		rows[f[0]] = f[3]
		if f[3] == "active" || f[3] == "confirmed" {
			var q int
			fmt.Sscan(f[2], &q)
			held += q
		}
		if told[f[0]] != f[3] {
			fmt.Fprintf(&b, "  %s: the ledger has %s (%s x%s, %s path); last answer about it: %s\n", f[0], f[3], f[1], f[2], f[4], orNone(told[f[0]]))
		}
	}
	for key, state := range told {
		if _, ok := rows[key]; !ok && state != "none" {
			fmt.Fprintf(&b, "  %s: not in the ledger; last answer about it: %s\n", key, state)
		}
	}
	return fmt.Sprintf("the ledger at the end: %d units active or confirmed; rows that differ from the last answer:\n%s", held, b.String())
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}

// truncate is the history as it stood at time t: the calls invoked by then; a
// call still in flight at t keeps its call but not its answer (a read is left
// out, anything else may or may not have taken effect). Every linearization of
// the whole history gives one of the truncation (the calls linearized after t
// are the ones in flight, and those may be skipped), so a truncation that is not
// linearizable proves the whole history is not.
func truncate(calls []*call, t int64) []*call {
	var out []*call
	for _, c := range calls {
		if c.Invoke > t {
			continue
		}
		if c.Return <= t || c.Ans.Kind == ansUnknown {
			out = append(out, c)
			continue
		}
		if c.Kind == kLookup || c.Kind == kShow {
			continue
		}
		cut := *c
		cut.Ans = answer{Kind: ansUnknown, Err: "in flight at the cut", Remaining: -1}
		out = append(out, &cut)
	}
	return out
}

// firstIllegal finds the earliest time by which the history is already not
// linearizable (a binary search over the calls' return times: once a truncation
// is illegal, every later one is), or -1.
func firstIllegal(calls []*call, cfg histConfig, deadline time.Time) (int64, []*call) {
	var times []int64
	for _, c := range calls {
		if c.Ans.Kind != ansUnknown && c.Return < unbounded {
			times = append(times, c.Return)
		}
	}
	sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
	illegalAt := func(t int64) ([]*call, bool) {
		cut := truncate(calls, t)
		sp, ops := translate(cut, cfg.Limit, cfg.Variants, cfg.PerUser, false, cfg.Clients)
		probe := max(time.Second, time.Until(deadline)/4)
		return cut, porcupine.CheckOperationsTimeout(sp.model(), ops, probe) == porcupine.Illegal
	}
	lo, hi := 0, len(times)-1
	var found []*call
	best := int64(-1)
	for lo <= hi && time.Now().Before(deadline) {
		mid := (lo + hi) / 2
		if cut, bad := illegalAt(times[mid]); bad {
			best, found = times[mid], cut
			hi = mid - 1
		} else {
			lo = mid + 1
		}
	}
	return best, found
}
