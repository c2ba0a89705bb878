package histories

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// redisCmd sends one command to the Redis at addr and returns its reply: a string,
// an int64, nil, a []any, or an error for an error reply.
func redisCmd(addr string, args ...string) (any, error) {
	conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := conn.Write([]byte(b.String())); err != nil {
		return nil, err
	}
	return readReply(bufio.NewReader(conn))
}

type redisError string

func (e redisError) Error() string { return string(e) }

func readReply(r *bufio.Reader) (any, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return nil, err
	}
	line = strings.TrimRight(line, "\r\n")
	if line == "" {
		return nil, errors.New("empty reply line")
	}
	body := line[1:]
	switch line[0] {
	case '+':
		return body, nil
	case '-':
		return nil, redisError(body)
	case ':':
		return strconv.ParseInt(body, 10, 64)
	case '$':
		n, err := strconv.Atoi(body)
		if err != nil {
			return nil, err
		}
		if n < 0 {
			return nil, nil
		}
		buf := make([]byte, n+2)
		if _, err := readFull(r, buf); err != nil {
			return nil, err
		}
		return string(buf[:n]), nil
	case '*':
		n, err := strconv.Atoi(body)
		if err != nil {
			return nil, err
		}
		if n < 0 {
			return nil, nil
		}
		items := make([]any, n)
		for i := range items {
			item, err := readReply(r)
			if err != nil {
				var re redisError
				if !errors.As(err, &re) {
					return nil, err
				}
				item = err
			}
			items[i] = item
		}
		return items, nil
	}
	return nil, fmt.Errorf("unexpected reply %q", line)
}

func readFull(r *bufio.Reader, buf []byte) (int, error) {
	n := 0
	for n < len(buf) {
		m, err := r.Read(buf[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// redisServer is one redis-server process on a fixed loopback port, restartable
// (with its data directory, or emptied).
type redisServer struct {
	port int
	dir  string
	log  string
	cmd  *exec.Cmd
	done chan struct{}
}

func (s *redisServer) addr() string { return fmt.Sprintf("127.0.0.1:%d", s.port) }

// start runs redis-server; replicaOf is "" or the port of its primary.
func (s *redisServer) start(replicaOf int) error {
	if err := os.MkdirAll(s.dir, 0o755); err != nil {
		return err
	}
	args := []string{
		"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
		"--dir", s.dir, "--logfile", s.log, "--protected-mode", "no",
		"--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
	}
	if replicaOf != 0 {
		args = append(args, "--replicaof", "127.0.0.1", strconv.Itoa(replicaOf))
	}
	cmd := exec.Command(redisServerBin, args...)
	// Killed with the test process, however it ends (a timeout's panic too).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	s.cmd = cmd
	s.done = make(chan struct{})
	go func(done chan struct{}) { _ = cmd.Wait(); close(done) }(s.done)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		// Whoever answers must be the process just started, not another server on
		// the port (this one then fails to bind and exits), and done loading.
		if reply, err := redisCmd(s.addr(), "INFO", "server"); err == nil {
			info, _ := reply.(string)
			ours := strings.Contains(info, fmt.Sprintf("process_id:%d\r\n", cmd.Process.Pid))
			if pong, err := redisCmd(s.addr(), "PING"); ours && err == nil && pong == "PONG" {
				return nil
			}
		}
		select {
		case <-s.done:
			return fmt.Errorf("redis-server on port %d exited at start (see %s)", s.port, s.log)
		case <-time.After(20 * time.Millisecond):
		}
	}
	return fmt.Errorf("redis-server on port %d did not answer PING", s.port)
}

// kill stops it with SIGKILL (as a crash) or SIGTERM (a clean shutdown that
// writes its append-only file) and waits.
func (s *redisServer) kill(sig syscall.Signal) {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(sig)
	select {
	case <-s.done:
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
	s.cmd = nil
}

func (s *redisServer) running() bool {
	if s.cmd == nil {
		return false
	}
	select {
	case <-s.done:
		return false
	default:
		return true
	}
}

// wipe removes its data (for a restart without it).
func (s *redisServer) wipe() error {
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(s.dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

// waitReplicaUp waits until the replica's link to its primary is up.
func waitReplicaUp(addr string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		reply, err := redisCmd(addr, "INFO", "replication")
		if s, ok := reply.(string); err == nil && ok && strings.Contains(s, "master_link_status:up") {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("replica %s: link to its primary not up within %s", addr, timeout)
}
