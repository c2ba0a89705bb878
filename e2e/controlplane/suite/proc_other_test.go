//go:build !linux

package suite

import "syscall"

func childAttrs() *syscall.SysProcAttr { return &syscall.SysProcAttr{} }
