package histories

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
)

var (
	redisServerBin = "/usr/bin/redis-server"
	psqlBin        = "/usr/bin/psql"
	sqlite3Bin     = "/usr/bin/sqlite3"
)

// maxSidecars is how many sidecar slots (each with its own proxy) a lab has.
const maxSidecars = 4

// lab holds the processes every history reuses: a Redis primary and its replica,
// one PostgreSQL cluster, and a proxy per sidecar slot in front of the primary.
// Each history gets a drop and a database of its own.
type lab struct {
	dir     string
	binDir  string
	redis   [2]*redisServer
	primary int // index into redis of the current primary
	pg      *postgres
	proxies [maxSidecars]*proxy
}

// missing names what the harness needs and this machine lacks ("" when nothing).
func missing(binDir string) string {
	var lacks []string
	for _, p := range []string{redisServerBin, psqlBin} {
		if _, err := os.Stat(p); err != nil {
			lacks = append(lacks, p)
		}
	}
	if postgresBinDir() == "" {
		lacks = append(lacks, "PostgreSQL (/usr/lib/postgresql/*/bin/initdb)")
	}
	for _, b := range []string{"dropgate-sidecar", "dropgate-operator"} {
		if st, err := os.Stat(filepath.Join(binDir, b)); err != nil || st.IsDir() {
			lacks = append(lacks, filepath.Join(binDir, b))
		}
	}
	return strings.Join(lacks, ", ")
}

// postgresBinDir is the newest /usr/lib/postgresql/N/bin with initdb.
func postgresBinDir() string {
	found, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	if len(found) == 0 {
		return ""
	}
	sort.Slice(found, func(i, j int) bool { return versionLess(found[i], found[j]) })
	return filepath.Dir(found[len(found)-1])
}

func versionLess(a, b string) bool {
	if len(a) != len(b) {
		return len(a) < len(b)
	}
	return a < b
}

var (
	portsMu    sync.Mutex
	portsGiven = map[int]bool{}
)

// freePort is a loopback port nothing listens on now and that this process has not
// handed out before. The lab's servers keep their ports across restarts, so two of
// them must never be given the same one: the second would fail to bind while its
// start-up check was answered by the first.
func freePort() (int, error) {
	portsMu.Lock()
	defer portsMu.Unlock()
	for range 100 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		if !portsGiven[port] {
			portsGiven[port] = true
			return port, nil
		}
	}
	return 0, errors.New("no loopback port left that was not handed out before")
}

func startLab(binDir, dir string) (*lab, error) {
	l := &lab{dir: dir, binDir: binDir}
	ok := false
	defer func() {
		if !ok {
			l.shutdown()
		}
	}()
	for i := range l.redis {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		l.redis[i] = &redisServer{
			port: port,
			dir:  filepath.Join(dir, fmt.Sprintf("redis%d", i)),
			log:  filepath.Join(dir, fmt.Sprintf("redis%d.log", i)),
		}
	}
	if err := l.redis[0].start(0); err != nil {
		return nil, err
	}
	if err := l.redis[1].start(l.redis[0].port); err != nil {
		return nil, err
	}
	pg, err := startPostgres(postgresBinDir(), dir)
	if err != nil {
		return nil, fmt.Errorf("PostgreSQL: %w", err)
	}
	l.pg = pg
	for i := range l.proxies {
		p, err := newProxy(l.redis[0].addr())
		if err != nil {
			return nil, err
		}
		l.proxies[i] = p
	}
	ok = true
	return l, nil
}

func (l *lab) primaryServer() *redisServer { return l.redis[l.primary] }
func (l *lab) replicaServer() *redisServer { return l.redis[1-l.primary] }

// reset brings the lab to its starting shape for a new history: both Redis servers
// up, the replica following the primary, every proxy forwarding to the primary,
// Redis empty.
func (l *lab) reset() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if l.pg.psql(ctx, "postgres", "SELECT 1") != nil {
		// A fault schedule that failed half-way may have left it stopped.
		_ = l.pg.start()
	}
	p, r := l.primaryServer(), l.replicaServer()
	if !p.running() {
		if err := p.start(0); err != nil {
			return err
		}
	}
	if _, err := redisCmd(p.addr(), "REPLICAOF", "NO", "ONE"); err != nil {
		return err
	}
	if !r.running() {
		if err := r.start(p.port); err != nil {
			return err
		}
	} else if _, err := redisCmd(r.addr(), "REPLICAOF", "127.0.0.1", fmt.Sprint(p.port)); err != nil {
		return err
	}
	for _, px := range l.proxies {
		px.set(forward, p.addr())
	}
	if _, err := redisCmd(p.addr(), "FLUSHALL"); err != nil {
		return err
	}
	if err := waitReplicaUp(r.addr(), 10*time.Second); err != nil {
		return fmt.Errorf("%w\nreplica's log:\n%s\nprimary's log:\n%s", err, tail(r.log, 15), tail(p.log, 15))
	}
	return nil
}

// tail is the last n lines of a log file (what a harness error shows of it).
func tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return "  " + strings.Join(lines, "\n  ")
}

func (l *lab) shutdown() {
	for _, px := range l.proxies {
		if px != nil {
			px.close()
		}
	}
	for _, r := range l.redis {
		if r != nil {
			r.kill(syscall.SIGKILL)
		}
	}
	if l.pg != nil {
		l.pg.shutdown()
	}
}

// apply runs the operator's one-shot reconcile of manifest against the primary.
func (l *lab) apply(manifest string) error {
	path := filepath.Join(l.dir, fmt.Sprintf("drop-%d.yaml", time.Now().UnixNano()))
	if err := os.WriteFile(path, []byte(manifest), 0o644); err != nil {
		return err
	}
	defer os.Remove(path)
	cmd := exec.Command(filepath.Join(l.binDir, "dropgate-operator"), "apply", "-f", path,
		"--redis-url", "redis://"+l.primaryServer().addr())
	cmd.Env = append(os.Environ(), "RUST_LOG=error")
	done := make(chan error, 1)
	var out []byte
	go func() {
		var err error
		out, err = cmd.CombinedOutput()
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("dropgate-operator apply: %v: %s", err, lastLines(string(out), 3))
		}
		return nil
	case <-time.After(20 * time.Second):
		if cmd.Process != nil {
			_ = cmd.Process.Kill()
		}
		<-done
		return errors.New("dropgate-operator apply: no answer within 20s")
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
