package histories

import (
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// repoRoot is the repository (two levels up from e2e/histories).
func repoRoot() string {
	wd, _ := os.Getwd()
	return filepath.Clean(filepath.Join(wd, "..", ".."))
}

func envInt(name string, def int) int {
	if v := os.Getenv(name); v != "" {
		if n, err := strconv.Atoi(v); err == nil {
			return n
		}
	}
	return def
}

var (
	labOnce sync.Once
	theLab  *lab
	labErr  error
	labSkip string
)

// sharedLab starts the lab once for every test of the run, or says why it cannot.
func sharedLab(t *testing.T) *lab {
	t.Helper()
	labOnce.Do(func() {
		binDir := os.Getenv("DROPGATE_BIN_DIR")
		if binDir == "" {
			binDir = filepath.Join(repoRoot(), "target", "debug")
		}
		if lacks := missing(binDir); lacks != "" {
			labSkip = "histories: SKIPPED: missing " + lacks
			return
		}
		// scripts/histories names a folder it cleans up however the run ends.
		dir, err := os.MkdirTemp(os.Getenv("DROPGATE_HISTORIES_DIR"), "dropgate-histories-")
		if err == nil {
			// PostgreSQL runs as user postgres under root: it must reach its folder.
			err = os.Chmod(dir, 0o755)
		}
		if err != nil {
			labErr = err
			return
		}
		theLab, labErr = startLab(binDir, dir)
	})
	if labSkip != "" {
		if os.Getenv("DROPGATE_REQUIRE_HISTORIES") == "1" {
			t.Fatalf("%s, and DROPGATE_REQUIRE_HISTORIES=1 requires the histories", labSkip)
		}
		t.Skip(labSkip)
	}
	if labErr != nil {
		t.Fatalf("the lab did not start: %v", labErr)
	}
	return theLab
}

func TestMain(m *testing.M) {
	// Interrupted: stop the lab's PostgreSQL too (its redis-server and sidecar
	// children die with this process).
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	go func() {
		sig := <-stop
		if theLab != nil && theLab.pg != nil {
			theLab.pg.shutdown()
		}
		fmt.Fprintf(os.Stderr, "histories: stopped by %s\n", sig)
		os.Exit(130)
	}()
	code := m.Run()
	if theLab != nil {
		theLab.shutdown()
		_ = os.RemoveAll(theLab.dir)
	}
	os.Exit(code)
}

func artifactsDir() string {
	if d := os.Getenv("DROPGATE_ARTIFACTS"); d != "" {
		return d
	}
	return filepath.Join(repoRoot(), "target", "histories")
}

func checkTimeout() time.Duration {
	return time.Duration(envInt("DROPGATE_CHECK_TIMEOUT_S", 60)) * time.Second
}

// diagnoseBudget bounds each step of a failure's diagnosis (the earliest illegal
// moment, the smallest failing history, the visualizations' searches): short in a
// run of many histories, longer when one seed or one saved history is looked at.
func diagnoseBudget() time.Duration {
	def := 5
	if os.Getenv("DROPGATE_SEED") != "" || os.Getenv("DROPGATE_RECHECK") != "" {
		def = 30
	}
	return time.Duration(envInt("DROPGATE_DIAGNOSE_S", def)) * time.Second
}

// TestHistories records seeded histories under faults against the real binaries
// and checks each against the drop's sequential model. DROPGATE_HISTORIES=n (50)
// histories from seed DROPGATE_SEED_BASE (1); DROPGATE_SEED=s replays one.
func TestHistories(t *testing.T) {
	l := sharedLab(t)
	seeds := []int64{}
	if s := os.Getenv("DROPGATE_SEED"); s != "" {
		seed, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("DROPGATE_SEED=%q: %v", s, err)
		}
		seeds = append(seeds, seed)
	} else {
		base := int64(envInt("DROPGATE_SEED_BASE", 1))
		for i := range envInt("DROPGATE_HISTORIES", 50) {
			seeds = append(seeds, base+int64(i))
		}
	}
	started := time.Now()
	var failed []string
	var totalOps int
	for _, seed := range seeds {
		o := runHistory(l, plan(seed), artifactsDir(), checkTimeout(), diagnoseBudget())
		if o.err != nil {
			t.Errorf("seed %d: the harness failed: %v\n%s", seed, o.err, o.cfg.schedule())
			failed = append(failed, fmt.Sprintf("%d (harness)", seed))
			continue
		}
		totalOps += o.ops
		t.Logf("seed %d: %d operations, recorded in %s (%s), checked in %s: %s", seed, o.ops, o.took.Round(time.Millisecond), o.phases, o.checked.Round(time.Millisecond), o.result)
		if o.result != porcupine.Ok {
			failed = append(failed, strconv.FormatInt(seed, 10))
			t.Logf("seed %d: triage: %d keys not linearizable on their own %v; without the drop's GET answers: %s", seed, len(o.badKeys), o.badKeys, o.withoutShows)
			t.Errorf("seed %d: %s\nschedule:\n%s\n%s\nvisualization: %s\nreport: %s",
				seed, o.cfg, o.cfg.schedule(), firstLines(o.report), o.artifact,
				filepath.Join(artifactsDir(), fmt.Sprintf("history-%d.txt", seed)))
		}
	}
	t.Logf("%d histories, %d operations, in %s; failing seeds: %v", len(seeds), totalOps, time.Since(started).Round(time.Second), failed)
}

// firstLines is a report up to its list of calls.
func firstLines(report string) string {
	if i := strings.Index(report, "\ncalls ("); i >= 0 {
		return report[:i]
	}
	return report
}

// TestCheckerCatchesBugs: histories recorded from the real sidecar with a
// deliberate bug armed (DROPGATE_FAULTS) are rejected within a few seeds, and the
// smallest failing history names what the bug did (not some other violation).
func TestCheckerCatchesBugs(t *testing.T) {
	l := sharedLab(t)
	bugs := []struct {
		name   string
		armed  string
		faults []fault // what makes the bug visible, if anything must
		// shows: the calls on a key whose own history is not linearizable are
		// this bug's doing.
		shows func(keyCalls []*call) bool
	}{
		// An admission answered 201 but never recorded: Redis losing its data and
		// being rebuilt from the ledger loses the reservation (a look-up, confirm
		// or cancel answers not_found, a retry is admitted afresh). Nothing else
		// on the key failed.
		{"skip-ledger-on-admit", "skip-ledger-on-admit@3", []fault{{Kind: "redis-wipe", Gap: 1200 * time.Millisecond}},
			func(keyCalls []*call) bool {
				admitted := false
				for _, c := range keyCalls {
					if c.Kind != kReserve && c.Ans.Kind != ansDefinite {
						return false
					}
					admitted = admitted || c.Ans.Outcome == "admitted"
				}
				return admitted
			}},
		// A cancel that Redis made, answered 503: the checker holds a 503 to
		// "changed nothing", and later answers show the cancel.
		{"error-after-redis-cancel", "error-after-redis-cancel@2", nil,
			func(keyCalls []*call) bool {
				for _, c := range keyCalls {
					if c.Kind == kCancel && c.Ans.Status == 503 && strings.Contains(c.Ans.Message, "injected") {
						return true
					}
				}
				return false
			}},
	}
	const tries = 4
	for _, bug := range bugs {
		t.Run(bug.name, func(t *testing.T) {
			for i := range tries {
				cfg := plan(int64(9000 + i))
				cfg.Bug = bug.armed
				cfg.SQLite, cfg.Sidecars = false, 2
				cfg.Faults = bug.faults
				cfg.MinOps = 400
				// Only the keys' answers are read (no GET of the drop, stock that
				// never runs out): what a violation can be about is the keys.
				cfg.NoShow = true
				cfg.Limit, cfg.Variants = 400, nil
				cfg.Permits = 64
				o := runHistory(l, cfg, filepath.Join(artifactsDir(), "bugs", bug.name), checkTimeout(), diagnoseBudget())
				if o.err != nil {
					t.Fatalf("seed %d: the harness failed: %v", cfg.Seed, o.err)
				}
				t.Logf("seed %d with %s: %d operations, checked in %s: %s", cfg.Seed, bug.armed, o.ops, o.checked.Round(time.Millisecond), o.result)
				if o.result != porcupine.Illegal {
					continue
				}
				for _, key := range o.badKeys {
					var keyCalls []*call
					for _, c := range o.calls {
						if c.Key == key {
							keyCalls = append(keyCalls, c)
						}
					}
					if bug.shows(keyCalls) {
						t.Logf("rejected; key %s's own history is not linearizable, and it shows the bug:\n%s", key, describeKeyCalls(o.calls, []string{key}))
						return
					}
				}
				t.Logf("rejected, but no key's own history shows the bug (keys not linearizable: %v)", o.badKeys)
			}
			t.Fatalf("%d histories with %s armed: none was rejected for it", tries, bug.armed)
		})
	}
}

// answered: some call of kind on key got outcome.
func answered(calls []*call, key string, kind callKind, outcome string) bool {
	for _, c := range calls {
		if c.Key == key && c.Kind == kind && c.Ans.Outcome == outcome {
			return true
		}
	}
	return false
}

// witnessPart is a report's smallest failing history.
func witnessPart(report string) string {
	if i := strings.Index(report, "smallest failing history"); i >= 0 {
		report = report[i:]
	}
	if i := strings.Index(report, "\nanswers:"); i >= 0 {
		report = report[:i]
	}
	return report
}

// TestRecheck checks a saved history again (DROPGATE_RECHECK=target/histories/history-N.json),
// for working on the model without recording anything.
func TestRecheck(t *testing.T) {
	path := os.Getenv("DROPGATE_RECHECK")
	if path == "" {
		t.Skip("DROPGATE_RECHECK names no saved history")
	}
	h, err := loadCalls(path)
	if err != nil {
		t.Fatal(err)
	}
	o := &outcome{cfg: h.Config}
	reading := check(o, h.Calls, h.Config, artifactsDir(), checkTimeout(), diagnoseBudget())
	t.Logf("%s: %d operations, %s in %s; visualization: %s\n%s", path, o.ops, o.result, o.checked.Round(time.Millisecond), o.artifact, reading)
}
