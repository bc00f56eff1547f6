package sock

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// recvmsg is recvmsg(2) on a connected socket: unix.Recvmsg without the
// sender's address, which costs that function an allocation per call.
func recvmsg(fd int, p, oob []byte, flags int) (n, oobn, rflags int, err error) {
	var iov unix.Iovec
	var msg unix.Msghdr
	if len(p) > 0 {
		iov.Base = &p[0]
		iov.SetLen(len(p))
		msg.Iov = &iov
		msg.SetIovlen(1)
	}
	if len(oob) > 0 {
		msg.Control = &oob[0]
		msg.SetControllen(len(oob))
	}
	r, _, e := unix.Syscall(unix.SYS_RECVMSG, uintptr(fd), uintptr(unsafe.Pointer(&msg)), uintptr(flags))
	if e != 0 {
		return 0, 0, 0, e
	}
	return int(r), int(msg.Controllen), int(msg.Flags), nil
}

// recvfrom is recv(2) into p, which must not be empty, without the
// sender's address (unix.Recvfrom asks for it, at an allocation).
func recvfrom(fd int, p []byte, flags int) (int, error) {
	r, _, e := unix.Syscall6(unix.SYS_RECVFROM, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)), uintptr(flags), 0, 0)
	if e != 0 {
		return 0, e
	}
	return int(r), nil
}
