package suite

import "syscall"

// childAttrs makes the kernel kill a started process if the test binary dies
// without stopping it, so that no operator or sidecar outlives a run.
func childAttrs() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
