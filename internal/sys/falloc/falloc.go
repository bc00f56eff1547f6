// Package falloc wraps fallocate(2): reserving the blocks behind a file range
// up front, and punching holes to hand them back.
//
// On hugetlbfs, allocating is how a missing hugepage becomes an error now
// instead of a SIGBUS at the first touch, and punching a hole is how a freed
// hugepage goes back to the kernel's pool while the file stays open.
package falloc

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// ErrNoSpace means the file system (the hugepage pool, for hugetlbfs) has no
// room for the requested range.
var ErrNoSpace = errors.New("falloc: no space left")

// Allocate makes sure blocks exist behind [off, off+length) of fd, growing
// the file when the range goes past its end.
func Allocate(fd int, off, length int64) error {
	err := fallocate(fd, 0, off, length)
	if errors.Is(err, unix.ENOSPC) {
		return fmt.Errorf("%w: allocating [0x%x, 0x%x) of fd %d", ErrNoSpace, off, off+length, fd)
	}
	if err != nil {
		return fmt.Errorf("falloc: allocate [0x%x, 0x%x) of fd %d: %w", off, off+length, fd, err)
	}
	return nil
}

// PunchHole releases the blocks behind [off, off+length) of fd without
// changing the file's size. Later reads of the range see zeros.
func PunchHole(fd int, off, length int64) error {
	if err := fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, length); err != nil {
		return fmt.Errorf("falloc: punch [0x%x, 0x%x) of fd %d: %w", off, off+length, fd, err)
	}
	return nil
}

func fallocate(fd int, mode uint32, off, length int64) error {
	for {
		err := unix.Fallocate(fd, mode, off, length)
		if err != unix.EINTR {
			return err
		}
	}
}

// hugetlbfsMagic is HUGETLBFS_MAGIC from linux/magic.h.
const hugetlbfsMagic = 0x958458f6

// BlockSize returns the allocation granularity of the file system that holds
// fd and whether it is hugetlbfs. On hugetlbfs the granularity is the mount's
// hugepage size: mappings and file offsets must be multiples of it.
func BlockSize(fd int) (size uint64, hugetlbfs bool, err error) {
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		return 0, false, fmt.Errorf("falloc: statfs fd %d: %w", fd, err)
	}
	return blockSize(&st)
}

// DirBlockSize is BlockSize for the file system holding dir.
func DirBlockSize(dir string) (size uint64, hugetlbfs bool, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, false, fmt.Errorf("falloc: statfs %s: %w", dir, err)
	}
	return blockSize(&st)
}

func blockSize(st *unix.Statfs_t) (uint64, bool, error) {
	if uint32(st.Type) == hugetlbfsMagic {
		return uint64(st.Bsize), true, nil
	}
	return uint64(unix.Getpagesize()), false, nil
}
