// Command controlplane runs a Kubernetes control plane as local processes, the way
// envtest does, for dropgate's end-to-end suite: an embedded etcd, kube-apiserver
// and (optionally) kube-controller-manager, all listening on free 127.0.0.1 ports.
//
//	controlplane [-dir DIR] [-controller-manager=true]
//	controlplane free-port      # prints a free 127.0.0.1 port (for scripts)
//
// It writes DIR/kubeconfig (a system:masters client certificate), prints that path
// on stdout once /readyz answers and every component is up, and stops everything
// on SIGTERM or SIGINT. The API server runs with RBAC authorization, the default
// admission plugins (so admission webhooks are on) and service-account token
// signing (TokenRequest, `kubectl create token`).
//
// The same binary is kube-apiserver and kube-controller-manager: it starts itself
// again with that name as its first argument, so each component is its own process
// with its own logs (DIR/*.log) and global state, as in a real cluster.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/embed"
	"k8s.io/component-base/cli"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

// The controllers kube-controller-manager runs: what finishes namespace deletion,
// garbage-collects owned objects, gives every namespace its default ServiceAccount
// and root CA ConfigMap, and turns Deployments into (never scheduled) Pods.
var controllers = []string{
	"namespace-controller",
	"garbage-collector-controller",
	"serviceaccount-controller",
	"root-ca-certificate-publisher-controller",
	"deployment-controller",
	"replicaset-controller",
	"clusterrole-aggregation-controller",
}

// Bounds of every wait, so that nothing hangs a CI run.
const (
	readyTimeout = 3 * time.Minute
	stopTimeout  = 20 * time.Second
)

func main() {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "kube-apiserver":
			os.Exit(runComponent(apiserver.NewAPIServerCommand()))
		case "kube-controller-manager":
			os.Exit(runComponent(controllermanager.NewControllerManagerCommand()))
		case "free-port": // for scripts: a free 127.0.0.1 port on stdout
			port, err := freePort()
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
			fmt.Println(port)
			return
		}
	}
	dir := flag.String("dir", "", "state folder: etcd data, certificates, kubeconfig, logs (default: a new temporary folder)")
	withKCM := flag.Bool("controller-manager", true, "also run kube-controller-manager (namespace deletion, garbage collection)")
	flag.Parse()
	if err := up(*dir, *withKCM); err != nil {
		fmt.Fprintf(os.Stderr, "controlplane: %v\n", err)
		os.Exit(1)
	}
}

// runComponent runs a component's cobra command with the arguments after its name.
func runComponent(command *cobra.Command) int {
	command.SetArgs(os.Args[2:])
	return cli.Run(command)
}

func up(dir string, withKCM bool) error {
	if dir == "" {
		d, err := os.MkdirTemp("", "dropgate-controlplane-")
		if err != nil {
			return err
		}
		dir = d
	}
	dir, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(dir, "pki"), 0o700); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	pki, err := writePKI(filepath.Join(dir, "pki"))
	if err != nil {
		return fmt.Errorf("certificates: %w", err)
	}

	etcd, etcdURL, err := startEtcd(dir)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	defer func() {
		etcd.Close()
		logf("etcd stopped")
	}()

	port, err := freePort()
	if err != nil {
		return err
	}
	server := fmt.Sprintf("https://127.0.0.1:%d", port)
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := writeKubeconfig(kubeconfig, server, pki); err != nil {
		return err
	}

	apiArgs := []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		fmt.Sprintf("--secure-port=%d", port),
		"--endpoint-reconciler-type=none",
		"--cert-dir=" + filepath.Join(dir, "pki"),
		"--tls-cert-file=" + pki.serverCert,
		"--tls-private-key-file=" + pki.serverKey,
		"--client-ca-file=" + pki.caCert,
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + pki.saPub,
		"--service-account-signing-key-file=" + pki.saKey,
		"--service-cluster-ip-range=10.0.0.0/24",
		"--allow-privileged=true",
		"--profiling=false",
	}
	children := &group{}
	defer children.stop()
	if err := children.start(ctx, dir, "kube-apiserver", apiArgs); err != nil {
		return err
	}
	if err := waitReady(ctx, server, pki, children); err != nil {
		return fmt.Errorf("kube-apiserver: %w (see %s)", err, filepath.Join(dir, "kube-apiserver.log"))
	}
	if withKCM {
		kcmArgs := []string{
			"--kubeconfig=" + kubeconfig,
			"--secure-port=0",
			"--leader-elect=false",
			"--use-service-account-credentials=false",
			"--root-ca-file=" + pki.caCert,
			"--controllers=" + strings.Join(controllers, ","),
			"--concurrent-gc-syncs=5",
		}
		if err := children.start(ctx, dir, "kube-controller-manager", kcmArgs); err != nil {
			return err
		}
	}
	logf("ready: %s (state in %s)", server, dir)
	fmt.Println(kubeconfig)

	select {
	case <-ctx.Done():
		logf("stopping")
		return nil
	case exited := <-children.exited:
		return fmt.Errorf("%s exited: %v (see %s)", exited.name, exited.err, filepath.Join(dir, exited.name+".log"))
	}
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "controlplane: "+format+"\n", args...)
}

// freePort asks the kernel for a free 127.0.0.1 port.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func startEtcd(dir string) (*embed.Etcd, string, error) {
	clientPort, err := freePort()
	if err != nil {
		return nil, "", err
	}
	peerPort, err := freePort()
	if err != nil {
		return nil, "", err
	}
	client := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", clientPort)}
	peer := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", peerPort)}
	cfg := embed.NewConfig()
	cfg.Name = "dropgate-e2e"
	cfg.Dir = filepath.Join(dir, "etcd")
	cfg.ListenClientUrls = []url.URL{client}
	cfg.AdvertiseClientUrls = []url.URL{client}
	cfg.ListenPeerUrls = []url.URL{peer}
	cfg.AdvertisePeerUrls = []url.URL{peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.UnsafeNoFsync = true // a throwaway store: speed over durability
	cfg.LogLevel = "warn"
	cfg.LogOutputs = []string{filepath.Join(dir, "etcd.log")}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, "", err
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, client.String(), nil
	case err := <-e.Err():
		e.Close()
		return nil, "", err
	case <-time.After(readyTimeout):
		e.Close()
		return nil, "", errors.New("not ready in time")
	}
}

// waitReady polls /readyz with the admin identity until it answers 200 (bounded).
func waitReady(ctx context.Context, server string, pki *pkiFiles, children *group) error {
	cert, err := tls.LoadX509KeyPair(pki.adminCert, pki.adminKey)
	if err != nil {
		return err
	}
	caPEM, err := os.ReadFile(pki.caCert)
	if err != nil {
		return err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(caPEM)
	client := &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{
			RootCAs:      roots,
			Certificates: []tls.Certificate{cert},
		}},
	}
	deadline := time.Now().Add(readyTimeout)
	last := "no answer yet"
	for time.Now().Before(deadline) {
		resp, err := client.Get(server + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = resp.Status
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case exited := <-children.exited:
			return fmt.Errorf("%s exited: %v", exited.name, exited.err)
		case <-time.After(300 * time.Millisecond):
		}
	}
	return fmt.Errorf("/readyz not OK after %s: %s", readyTimeout, last)
}

// group is the child processes, stopped in reverse start order.
type group struct {
	procs  []*child
	exited chan exit
}

type child struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

type exit struct {
	name string
	err  error
}

func (g *group) start(ctx context.Context, dir, name string, args []string) error {
	if g.exited == nil {
		g.exited = make(chan exit, 8)
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	logFile, err := os.Create(filepath.Join(dir, name+".log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(self, append([]string{name}, args...)...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = childAttrs()
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return fmt.Errorf("start %s: %w", name, err)
	}
	c := &child{name: name, cmd: cmd, done: make(chan struct{})}
	g.procs = append(g.procs, c)
	go func() {
		err := cmd.Wait()
		logFile.Close()
		close(c.done)
		if ctx.Err() == nil {
			g.exited <- exit{name: name, err: err}
		}
	}()
	return nil
}

func (g *group) stop() {
	for i := len(g.procs) - 1; i >= 0; i-- {
		c := g.procs[i]
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.done:
		case <-time.After(stopTimeout):
			logf("%s did not stop in %s: killing it", c.name, stopTimeout)
			_ = c.cmd.Process.Kill()
			<-c.done
		}
		logf("%s stopped", c.name)
	}
	g.procs = nil
}
