package testenv

import (
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// MemfdWithInode makes a memfd whose inode number is ino, as an
// application's memfd may happen to share a tmpfs backing file's: memfds
// live on the kernel's own shmem mount, whose inode numbers come from a
// counter of their own, handed to each CPU in batches, and tmpfs numbers
// are small too. It makes memfds on one CPU at a time (so that the numbers
// it gets are consecutive) until one has ino, and fails if the numbers are
// past ino or more than a million below it. The thread stays bound to the
// last CPU tried: call it from a helper process.
func MemfdWithInode(ino uint64) (int, error) {
	runtime.LockOSThread()
	for cpu := range runtime.NumCPU() {
		var set unix.CPUSet
		set.Set(cpu)
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			return -1, err
		}
		for i := 0; ; i++ {
			fd, err := unix.MemfdCreate("twin", 0)
			if err != nil {
				return -1, err
			}
			var st unix.Stat_t
			if err := unix.Fstat(fd, &st); err != nil {
				return -1, err
			}
			if st.Ino == ino {
				return fd, nil
			}
			unix.Close(fd)
			if st.Ino > ino || i == 0 && ino-st.Ino > 1<<20 {
				break
			}
		}
	}
	return -1, fmt.Errorf("memfd inode numbers here are past %d, or too far below it", ino)
}
