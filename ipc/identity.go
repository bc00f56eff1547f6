package ipc

import (
	"bytes"
	"os"
	"strconv"

	"github.com/mpmr/mpmr/internal/sys/sock"
)

// identity pins the process that made a connection. SO_PEERCRED's pid is
// only a number: once that process exits, another may get it, and a hello
// that names the pid would then speak for the newcomer. A pidfd names the
// process itself; where the kernel gives none (before Linux 6.5), the
// process's start time, read when the connection is accepted, stands in.
type identity struct {
	pidfd *os.File
	pid   int
	start []byte // /proc/PID/stat's start time field at accept, without pidfd
}

func pin(c *Conn, pid int) identity {
	if f, err := c.c.PeerPidfd(); err == nil {
		return identity{pidfd: f, pid: pid}
	}
	return identity{pid: pid, start: startOf(pid)}
}

// alive reports whether the process that made the connection has not
// exited.
func (id identity) alive() bool {
	if id.pidfd != nil {
		return sock.PidfdAlive(id.pidfd)
	}
	now := startOf(id.pid)
	return now != nil && bytes.Equal(now, id.start)
}

// watch calls gone once the process that made the connection has exited.
// The end of the connection usually says so first, but not when a child
// the process forked holds the connection (and its call lane): then this
// is the only sign. It waits in the network poller, where a pidfd becomes
// readable when its process has exited (a zombie included), on a
// goroutine that ends when the identity is closed. Without a pidfd it
// does nothing.
func (id identity) watch(gone func()) {
	if id.pidfd == nil {
		return
	}
	rc, err := id.pidfd.SyscallConn()
	if err != nil {
		return
	}
	go func() {
		if rc.Read(sock.PidfdExited) == nil {
			gone()
		}
	}()
}

func (id identity) close() {
	if id.pidfd != nil {
		id.pidfd.Close()
	}
}

// startOf returns the start time field of process pid (field 22 of
// /proc/PID/stat), or nil.
func startOf(pid int) []byte {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil
	}
	return statStart(b)
}

// statStart returns the start time field of b, a /proc/PID/stat, or nil.
func statStart(b []byte) []byte {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	f := bytes.Fields(b[i+1:])
	if len(f) <= 22-3 {
		return nil
	}
	return f[22-3]
}
