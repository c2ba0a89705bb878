package histories

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// postgres is a throwaway PostgreSQL cluster on a loopback port, run as user
// postgres when the harness runs as root (PostgreSQL refuses root), with the flags
// testkit/src/postgres.rs uses.
type postgres struct {
	bin  string
	dir  string
	port int
	root bool
}

// pgCommand runs a PostgreSQL program, as user postgres under root.
func (pg *postgres) command(ctx context.Context, program string, args ...string) *exec.Cmd {
	path := filepath.Join(pg.bin, program)
	if pg.root {
		return exec.CommandContext(ctx, "runuser", append([]string{"-u", "postgres", "--", path}, args...)...)
	}
	return exec.CommandContext(ctx, path, args...)
}

func runQuiet(cmd *exec.Cmd) error {
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", strings.Join(cmd.Args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func startPostgres(bin, parent string) (*postgres, error) {
	dir, err := os.MkdirTemp(parent, "pg")
	if err != nil {
		return nil, err
	}
	pg := &postgres{bin: bin, dir: dir, root: os.Geteuid() == 0}
	if pg.root {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("running as root needs a postgres user: %v", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := runQuiet(pg.command(ctx, "initdb", "-A", "trust", "-U", "postgres", "--no-sync", "-D", pg.data())); err != nil {
		return nil, err
	}
	var last error
	for range 5 {
		pg.port, err = freePort()
		if err != nil {
			return nil, err
		}
		if last = pg.start(); last == nil {
			return pg, nil
		}
	}
	return nil, last
}

func (pg *postgres) data() string { return filepath.Join(pg.dir, "data") }

func (pg *postgres) start() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	opts := fmt.Sprintf("-c listen_addresses=127.0.0.1 -c port=%d -c unix_socket_directories=%s -c fsync=off -c max_connections=200", pg.port, pg.dir)
	return runQuiet(pg.command(ctx, "pg_ctl", "-w", "-t", "30", "-D", pg.data(), "-o", opts, "-l", filepath.Join(pg.dir, "log"), "start"))
}

// stop stops it at once (`-m immediate`: as a crash, no checkpoint).
func (pg *postgres) stop() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return runQuiet(pg.command(ctx, "pg_ctl", "-m", "immediate", "-D", pg.data(), "stop"))
}

func (pg *postgres) url(db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s", pg.port, db)
}

// psql runs SQL against database db.
func (pg *postgres) psql(ctx context.Context, db, sql string) error {
	cmd := exec.CommandContext(ctx, psqlBin, "-X", "-q", "-v", "ON_ERROR_STOP=1",
		"-h", "127.0.0.1", "-p", strconv.Itoa(pg.port), "-U", "postgres", "-d", db, "-c", sql)
	return runQuiet(cmd)
}

// query runs SQL against database db and returns its rows, fields separated by |.
func (pg *postgres) query(db, sql string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, psqlBin, "-X", "-q", "-A", "-t", "-F", "|",
		"-h", "127.0.0.1", "-p", strconv.Itoa(pg.port), "-U", "postgres", "-d", db, "-c", sql)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%v: %s", err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

func (pg *postgres) createDatabase(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_ = pg.psql(ctx, "postgres", fmt.Sprintf("DROP DATABASE IF EXISTS %s WITH (FORCE)", name))
	return pg.psql(ctx, "postgres", fmt.Sprintf("CREATE DATABASE %s", name))
}

func (pg *postgres) dropDatabase(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_ = pg.psql(ctx, "postgres", fmt.Sprintf("DROP DATABASE IF EXISTS %s WITH (FORCE)", name))
}

// stall holds an exclusive lock on the ledger's reservations table for d: every
// ledger write waits (past the pending bound when d is long enough).
func (pg *postgres) stall(db string, d time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), d+30*time.Second)
	defer cancel()
	sql := fmt.Sprintf("BEGIN; LOCK TABLE reservations IN ACCESS EXCLUSIVE MODE; SELECT pg_sleep(%.3f); COMMIT;", d.Seconds())
	return pg.psql(ctx, db, sql)
}

func (pg *postgres) shutdown() {
	_ = pg.stop()
	_ = os.RemoveAll(pg.dir)
}
