package histories

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// sidecar is one slot: a dropgate-sidecar process on a fixed port, behind its own
// Redis proxy, restartable after a kill -9 with the same flags.
type sidecar struct {
	index  int
	port   int
	args   []string
	env    []string
	logDir string

	mu     sync.Mutex
	cmd    *exec.Cmd
	done   chan struct{}
	gen    int       // how many times it was started
	killed time.Time // when the last kill -9 landed (zero: never)
	up     bool
	log    *os.File
}

func (s *sidecar) base() string { return fmt.Sprintf("http://127.0.0.1:%d", s.port) }

// newSidecar prepares slot i: listening on a free port, Redis through proxy px.
func newSidecar(binDir string, i int, px *proxy, databaseURL string, logDir string, env []string) (*sidecar, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	s := &sidecar{
		index: i,
		port:  port,
		args: []string{
			filepath.Join(binDir, "dropgate-sidecar"),
			"--listen", fmt.Sprintf("127.0.0.1:%d", port),
			"--redis-url", fmt.Sprintf("redis://127.0.0.1:%d", px.port()),
			"--namespace", "shop",
			"--database-url", databaseURL,
			"--refresh-ms", "100",
			"--sweep-ms", "100",
		},
		env:    env,
		logDir: logDir,
	}
	return s, nil
}

func (s *sidecar) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.log == nil {
		f, err := os.Create(filepath.Join(s.logDir, fmt.Sprintf("sidecar%d.log", s.index)))
		if err != nil {
			return err
		}
		s.log = f
	}
	fmt.Fprintf(s.log, "=== start %d at %s\n", s.gen+1, time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(s.args[0], s.args[1:]...)
	// No API server to watch here: an outage's fallback decides on the config
	// last read, opted in (the sidecar refuses it by default).
	base := append(cleanEnv(), "RUST_LOG=warn,warp::server=off", "DROPGATE_FALLBACK_ON_LAST_READ_CONFIG=true")
	cmd.Env = append(base, s.env...)
	cmd.Stdout = s.log
	cmd.Stderr = s.log
	// Killed with the test process, however it ends (a timeout's panic too).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	s.cmd = cmd
	s.done = make(chan struct{})
	s.gen++
	go func(done chan struct{}) { _ = cmd.Wait(); close(done) }(s.done)
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := client.Get(s.base() + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				s.up = true
				return nil
			}
		}
		select {
		case <-s.done:
			return fmt.Errorf("sidecar %d exited at start (see %s)", s.index, s.log.Name())
		case <-time.After(20 * time.Millisecond):
		}
	}
	return fmt.Errorf("sidecar %d did not answer /healthz within 15s", s.index)
}

// cleanEnv is the harness's environment without what would change the sidecar's
// behaviour behind its flags' back.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if len(kv) > 9 && kv[:9] == "DROPGATE_" || len(kv) > 5 && kv[:5] == "OTEL_" || len(kv) > 9 && kv[:9] == "RUST_LOG=" {
			continue
		}
		env = append(env, kv)
	}
	return env
}

// kill9 kills the process with SIGKILL and waits; it returns the kill's time.
func (s *sidecar) kill9() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.up = false
	if s.cmd == nil {
		return time.Now()
	}
	at := time.Now()
	_ = s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.done
	s.killed = at
	s.cmd = nil
	return at
}

// state is its generation and the time of its last kill, read together.
func (s *sidecar) state() (gen int, killed time.Time, up bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.gen, s.killed, s.up
}

func (s *sidecar) stop() {
	s.kill9()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.log != nil {
		_ = s.log.Close()
		s.log = nil
	}
}
