// Package owner says who made a file that was found where this process
// meant to create its own.
package owner

import (
	"fmt"
	"io/fs"
	"os"
	"syscall"
)

// Foreign describes the file at path, without following a link, if it is
// not a regular file of this process's effective user ("a FIFO of uid
// 1001"): one that another user, or something other than an instance,
// put there. It returns "" for a regular file of this user, a gone file,
// and one that cannot be looked at.
func Foreign(path string) string {
	fi, err := os.Lstat(path)
	if err != nil {
		return ""
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return ""
	}
	if fi.Mode().IsRegular() && int(st.Uid) == os.Geteuid() {
		return ""
	}
	return fmt.Sprintf("%s of uid %d", kind(fi.Mode()), st.Uid)
}

func kind(m fs.FileMode) string {
	switch {
	case m.IsRegular():
		return "a file"
	case m.IsDir():
		return "a directory"
	case m&fs.ModeSymlink != 0:
		return "a symbolic link"
	case m&fs.ModeNamedPipe != 0:
		return "a FIFO"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeDevice != 0:
		return "a device"
	}
	return "a special file"
}
