// Package suite is dropgate's end-to-end suite against a real Kubernetes API server.
//
// Each scenario drives only public surfaces: kubectl, helm, the sidecar's HTTP API
// and redis-cli, with dropgate-operator and dropgate-sidecar as real processes.
// scripts/e2e-local starts the control plane (e2e/controlplane) and a redis-server
// and runs it; pointed at another cluster's kubeconfig it runs the same way:
//
//	KUBECONFIG=...                   admin kubeconfig of the cluster (required)
//	DROPGATE_E2E_REDIS_URL=redis://127.0.0.1:PORT   a Redis this machine reaches (required)
//	DROPGATE_E2E_DATABASE_URL=postgres://...  a PostgreSQL ledger that two sidecars
//	                                 share (without it: one sidecar, SQLite ledger)
//	DROPGATE_E2E_BIN=target/debug    where dropgate-operator and dropgate-sidecar are
//	DROPGATE_E2E_WORK=DIR            where process logs and ledgers go (default: a temp dir)
//	DROPGATE_E2E_HELM_SET=a=b,c=d    extra `helm --set` values (a cluster that runs
//	                                 pods wants operator.replicas=0: the suite's
//	                                 operator process must be the only one)
//
// kubectl, helm and redis-cli come from PATH.
package suite

import (
	"os"
	"path/filepath"
	"testing"
)

// A scenario is one named end-to-end test. Adding one: write
// `func myScenario(t *testing.T, e *env)` and add a line here.
type scenario struct {
	name string
	run  func(t *testing.T, e *env)
}

var scenarios = []scenario{
	{"helm_install_real_api", helmInstallRealAPI},
	{"helm_chart_on_real_api", helmChartOnRealAPI},
	{"operator_rbac_is_enough", operatorRBACIsEnough},
	{"kubectl_apply_drop_lifecycle", kubectlApplyDropLifecycle},
	{"sidecar_injected_by_webhook", sidecarInjectedByWebhook},
	{"fallback_obeys_a_change_published_while_cut_off", fallbackObeysAChangePublishedWhileCutOff},
	{"fallback_waits_for_a_watch_it_may_not_run", fallbackWaitsForAWatchItMayNotRun},
	{"no_self_triggered_reconcile", noSelfTriggeredReconcile},
	{"leader_failover", leaderFailover},
	{"namespace_deletion_finishes", namespaceDeletionFinishes},
	{"invalid_drops_rejected_at_apply", invalidDropsRejectedAtApply},
	{"ha_blip_keeps_mode", haBlipKeepsMode},
}

func TestScenarios(t *testing.T) {
	e := newEnv(t)
	for _, s := range scenarios {
		t.Run(s.name, func(t *testing.T) {
			t.Cleanup(func() {
				if t.Failed() {
					e.dumpLogs(t)
				}
			})
			s.run(t, e)
		})
	}
}

// newEnv reads the suite's settings; without a cluster the suite skips.
func newEnv(t *testing.T) *env {
	kubeconfig := os.Getenv("KUBECONFIG")
	redisURL := os.Getenv("DROPGATE_E2E_REDIS_URL")
	if kubeconfig == "" || redisURL == "" {
		t.Skip("KUBECONFIG and DROPGATE_E2E_REDIS_URL are not set: run scripts/e2e-local")
	}
	repo, err := filepath.Abs(filepath.Join("..", "..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	bin := os.Getenv("DROPGATE_E2E_BIN")
	if bin == "" {
		bin = filepath.Join(repo, "target", "debug")
	}
	work := os.Getenv("DROPGATE_E2E_WORK")
	if work == "" {
		work = t.TempDir()
	}
	e := &env{
		repo:        repo,
		bin:         bin,
		work:        work,
		kubeconfig:  kubeconfig,
		redisURL:    redisURL,
		databaseURL: os.Getenv("DROPGATE_E2E_DATABASE_URL"),
		helmSet:     os.Getenv("DROPGATE_E2E_HELM_SET"),
	}
	t.Cleanup(e.stopAll)
	return e
}
