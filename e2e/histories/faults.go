package histories

import (
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// fault is one step of a history's seeded schedule.
type fault struct {
	Kind   string
	Target int           // the sidecar (kill-sidecar, cut)
	Dur    time.Duration // how long it lasts (down, cut, stalled, switched off, ended)
	Value  int           // limit: the new limitedQuantity (or variant Target's quantity); cut: 0 refuse, 1 blackhole
	Gap    time.Duration // pause before it
}

func (f fault) String() string {
	switch f.Kind {
	case "kill-sidecar":
		return fmt.Sprintf("kill -9 sidecar %d, restarted after %s", f.Target, f.Dur)
	case "redis-restart":
		return "Redis primary restarted with its data (SIGTERM, append-only file kept)"
	case "redis-wipe":
		return "Redis primary killed and restarted without its data, then apply re-run"
	case "failover":
		return fmt.Sprintf("failover: replica detached, %s of writes it misses, primary killed, replica promoted", f.Dur)
	case "cut":
		how := "connections refused"
		if f.Value == 1 {
			how = "connections blackholed"
		}
		return fmt.Sprintf("Redis cut off for sidecar %d for %s (%s)", f.Target, f.Dur, how)
	case "pg-restart":
		return fmt.Sprintf("PostgreSQL stopped (-m immediate) for %s, restarted", f.Dur)
	case "ledger-stall":
		return fmt.Sprintf("ledger stalled for %s (exclusive lock on reservations)", f.Dur)
	case "kill-switch":
		return fmt.Sprintf("kill switch off (gate.enabled false) for %s", f.Dur)
	case "limit":
		if f.Target >= 0 {
			return fmt.Sprintf("variant %s's quantity set to %d", variantName(f.Target), f.Value)
		}
		return fmt.Sprintf("limitedQuantity set to %d", f.Value)
	case "ends":
		return fmt.Sprintf("endsAt moved into the past for %s, then into the future", f.Dur)
	}
	return f.Kind
}

// histConfig is everything a seed decides about a history.
type histConfig struct {
	Seed      int64
	SQLite    bool // one sidecar with a per-pod SQLite ledger (else a shared PostgreSQL one)
	Sidecars  int
	Clients   int
	Limit     int   // the drop's (with variants, their sum)
	Variants  []int // the variants' quantities (V0, V1, ...); none: a drop without variants
	PerUser   int
	Users     int
	Permits   int
	AcquireMs int
	Faults    []fault
	MinOps    int
	Bug       string // DROPGATE_FAULTS for the sidecars (the checker's own test)
	NoShow    bool   // no GET of the drop (the checker's own test looks at keys)
}

func (c histConfig) String() string {
	ledger := fmt.Sprintf("%d sidecars sharing a PostgreSQL ledger", c.Sidecars)
	if c.SQLite {
		ledger = "1 sidecar with a per-pod SQLite ledger"
	}
	s := fmt.Sprintf("seed %d: %s, %d clients, limit %d, perUserLimit %d, %d buyers, permits %d, acquireTimeoutMs %d",
		c.Seed, ledger, c.Clients, c.Limit, c.PerUser, c.Users, c.Permits, c.AcquireMs)
	if len(c.Variants) > 0 {
		s += fmt.Sprintf(", variants %v", c.Variants)
	}
	if c.Bug != "" {
		s += ", DROPGATE_FAULTS=" + c.Bug
	}
	return s
}

func (c histConfig) schedule() string {
	var lines []string
	for i, f := range c.Faults {
		lines = append(lines, fmt.Sprintf("  %d. after %s: %s", i+1, f.Gap, f))
	}
	return strings.Join(lines, "\n")
}

// duration estimates how long the schedule runs.
func (c histConfig) duration() time.Duration {
	var d time.Duration
	for _, f := range c.Faults {
		d += f.Gap + f.Dur + 150*time.Millisecond
		switch f.Kind {
		case "redis-wipe", "failover", "pg-restart":
			d += 300 * time.Millisecond
		}
	}
	return d
}

// variantName is variant i's name in a history's drop.
func variantName(i int) string { return fmt.Sprintf("V%d", i) }

func ms(rng *rand.Rand, lo, hi int) time.Duration {
	return time.Duration(lo+rng.Intn(hi-lo+1)) * time.Millisecond
}

// plan is the history a seed names.
func plan(seed int64) histConfig {
	rng := rand.New(rand.NewSource(seed))
	c := histConfig{Seed: seed, MinOps: 500, PerUser: 2}
	c.SQLite = rng.Intn(5) == 0
	c.Sidecars = 1
	if !c.SQLite {
		c.Sidecars = 2 + rng.Intn(3)
	}
	c.Clients = 6 + rng.Intn(5)
	c.Limit = 8 + rng.Intn(25)
	// Every other history sells a drop in sizes, from a draw of its own (so the
	// other draws, and so the schedules, stay as the seed had them).
	if sizes := rand.New(rand.NewSource(seed ^ 0x5eed51e5)); sizes.Intn(2) == 0 {
		c.Variants = make([]int, 2+sizes.Intn(3))
		c.Limit = 0
		for i := range c.Variants {
			c.Variants[i] = 2 + sizes.Intn(10)
			c.Limit += c.Variants[i]
		}
	}
	c.Users = 15 + rng.Intn(15)
	c.Permits = []int{8, 16, 64, 64}[rng.Intn(4)]
	c.AcquireMs = []int{20, 50, 100}[rng.Intn(3)]
	infra := []string{"kill-sidecar", "redis-restart", "redis-wipe", "failover", "cut", "pg-restart", "ledger-stall"}
	if c.SQLite {
		infra = []string{"kill-sidecar", "redis-restart", "redis-wipe", "failover", "cut"}
		if _, err := os.Stat(sqlite3Bin); err == nil {
			infra = append(infra, "ledger-stall")
		}
	}
	var faults []fault
	for range 1 + rng.Intn(2) {
		faults = append(faults, c.infraFault(rng, infra[rng.Intn(len(infra))]))
	}
	for range rng.Intn(3) {
		faults = append(faults, c.configFault(rng, []string{"kill-switch", "limit", "ends"}[rng.Intn(3)]))
	}
	rng.Shuffle(len(faults), func(i, j int) { faults[i], faults[j] = faults[j], faults[i] })
	for i := range faults {
		faults[i].Gap = ms(rng, 200, 600)
	}
	c.Faults = faults
	return c
}

func (c histConfig) infraFault(rng *rand.Rand, kind string) fault {
	f := fault{Kind: kind, Target: rng.Intn(c.Sidecars)}
	switch kind {
	case "kill-sidecar":
		f.Dur = ms(rng, 200, 800)
	case "failover":
		f.Dur = ms(rng, 300, 800)
	case "cut":
		f.Dur = ms(rng, 500, 2500)
		f.Value = rng.Intn(2)
	case "pg-restart":
		f.Dur = ms(rng, 300, 1500)
	case "ledger-stall":
		// Past the pending bound: acquireTimeoutMs + the ledger's 2 s commit deadline.
		f.Dur = time.Duration(c.AcquireMs)*time.Millisecond + 2*time.Second + ms(rng, 500, 1500)
	}
	return f
}

func (c histConfig) configFault(rng *rand.Rand, kind string) fault {
	f := fault{Kind: kind, Target: -1}
	switch kind {
	case "kill-switch":
		f.Dur = ms(rng, 400, 1500)
	case "limit":
		// A raise or a cut (possibly below what is held); with variants, of one.
		f.Value = max(0, c.Limit+rng.Intn(17)-10)
		if len(c.Variants) > 0 {
			f.Target = f.Value % len(c.Variants)
			f.Value = max(0, c.Variants[f.Target]+f.Value%9-5)
		}
	case "ends":
		f.Dur = ms(rng, 300, 1000)
	}
	return f
}

// inject runs one fault (blocking for its duration).
func (w *world) inject(f fault) error {
	l := w.lab
	switch f.Kind {
	case "kill-sidecar":
		sc := w.sidecars[f.Target]
		sc.kill9()
		w.event("kill -9 sidecar %d", f.Target)
		time.Sleep(f.Dur)
		if err := sc.start(); err != nil {
			return err
		}
		w.event("sidecar %d restarted", f.Target)
	case "redis-restart":
		p := l.primaryServer()
		p.kill(syscall.SIGTERM)
		w.event("Redis primary stopped (SIGTERM)")
		if err := p.start(0); err != nil {
			return err
		}
		w.event("Redis primary restarted with its data")
	case "redis-wipe":
		p := l.primaryServer()
		p.kill(syscall.SIGKILL)
		w.event("Redis primary killed")
		if err := p.wipe(); err != nil {
			return err
		}
		if err := p.start(0); err != nil {
			return err
		}
		w.event("Redis primary restarted empty")
		w.applyChange(applyChange{What: "reconcile"})
	case "failover":
		p, r := l.primaryServer(), l.replicaServer()
		if _, err := redisCmd(r.addr(), "REPLICAOF", "NO", "ONE"); err != nil {
			return err
		}
		w.event("replica detached (it misses every write from now on)")
		time.Sleep(f.Dur)
		p.kill(syscall.SIGKILL)
		w.event("Redis primary killed")
		l.primary = 1 - l.primary
		for _, px := range l.proxies {
			px.set(forward, r.addr())
		}
		w.event("sidecars pointed at the promoted replica")
		w.applyChange(applyChange{What: "reconcile"})
		if err := p.wipe(); err != nil {
			return err
		}
		if err := p.start(r.port); err != nil {
			return err
		}
		w.event("old primary back as an empty replica of the new one")
	case "cut":
		mode := refuse
		if f.Value == 1 {
			mode = blackhole
		}
		px := l.proxies[f.Target]
		px.set(mode, l.primaryServer().addr())
		w.event("Redis cut off for sidecar %d", f.Target)
		time.Sleep(f.Dur)
		px.set(forward, l.primaryServer().addr())
		w.event("Redis reachable again for sidecar %d", f.Target)
	case "pg-restart":
		if err := l.pg.stop(); err != nil {
			return err
		}
		w.event("PostgreSQL stopped")
		time.Sleep(f.Dur)
		if err := l.pg.start(); err != nil {
			return err
		}
		w.event("PostgreSQL started")
	case "ledger-stall":
		w.event("ledger stall begins")
		var err error
		if w.cfg.SQLite {
			err = sqliteStall(w.sqlitePath, f.Dur)
		} else {
			err = l.pg.stall(w.db, f.Dur)
		}
		if err != nil {
			return err
		}
		w.event("ledger stall ends")
	case "kill-switch":
		w.applyChange(applyChange{What: "gate", Gate: false})
		time.Sleep(f.Dur)
		w.applyChange(applyChange{What: "gate", Gate: true})
	case "limit":
		w.applyChange(applyChange{What: "limit", Limit: f.Value, Variant: f.Target})
	case "ends":
		w.applyChange(applyChange{What: "ends", Ended: true})
		time.Sleep(f.Dur)
		w.applyChange(applyChange{What: "ends", Ended: false})
	default:
		return fmt.Errorf("unknown fault %q", f.Kind)
	}
	return nil
}

// sqliteStall holds an exclusive transaction on a SQLite ledger for d.
func sqliteStall(path string, d time.Duration) error {
	cmd := exec.Command(sqlite3Bin, path)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		return err
	}
	_, _ = io.WriteString(stdin, ".timeout 5000\nBEGIN EXCLUSIVE;\n")
	time.Sleep(d)
	_, _ = io.WriteString(stdin, "COMMIT;\n.quit\n")
	_ = stdin.Close()
	return cmd.Wait()
}
