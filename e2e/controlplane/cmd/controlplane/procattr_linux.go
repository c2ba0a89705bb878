package main

import "syscall"

// childAttrs makes the kernel kill a component if this process dies without
// stopping it (kill -9, a crash), so no orphan keeps a port or the etcd data.
func childAttrs() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
