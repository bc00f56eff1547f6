package hugetlb

import (
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/sys/falloc"
)

// Kind names a backend for shared files.
type Kind int

// Backend kinds.
const (
	// Auto picks hugetlbfs when a writable mount of the wanted page size
	// has enough free pages, and tmpfs otherwise.
	Auto Kind = iota
	// Hugetlbfs uses real hugepages: physically contiguous pages and few
	// TLB entries.
	Hugetlbfs
	// Tmpfs uses ordinary shared memory files (DefaultTmpfsDir) with the
	// same page granularity, so everything above behaves the same.
	Tmpfs
)

func (k Kind) String() string {
	switch k {
	case Auto:
		return "auto"
	case Hugetlbfs:
		return "hugetlbfs"
	case Tmpfs:
		return "tmpfs"
	}
	return fmt.Sprintf("kind(%d)", int(k))
}

// MarshalText names the kind, for JSON.
func (k Kind) MarshalText() ([]byte, error) { return []byte(k.String()), nil }

// UnmarshalText reads what MarshalText wrote (see ParseKind).
func (k *Kind) UnmarshalText(b []byte) error {
	v, err := ParseKind(string(b))
	if err == nil {
		*k = v
	}
	return err
}

// ParseKind parses "auto", "hugetlbfs" (or "hugetlb") and "tmpfs" (or
// "shm"); the empty string means Auto.
func ParseKind(s string) (Kind, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "auto":
		return Auto, nil
	case "hugetlbfs", "hugetlb", "huge":
		return Hugetlbfs, nil
	case "tmpfs", "shm":
		return Tmpfs, nil
	}
	return Auto, fmt.Errorf("hugetlb: unknown backend %q (want auto, hugetlbfs or tmpfs)", s)
}

// Want says what backend a caller needs.
type Want struct {
	Kind     Kind
	PageSize uint64 // 0: the system's default hugepage size
	Pages    uint64 // pages that must be free now (hugetlbfs); 0 means 1
	Dir      string // use this directory instead of searching (optional)
}

// Backend is a chosen place for shared files.
type Backend struct {
	Kind     Kind   // Hugetlbfs or Tmpfs, never Auto
	Dir      string // where the files go
	PageSize uint64 // page granularity of mappings and allocations
	Reason   string // why this one was chosen, for the log and the user
}

func (b Backend) String() string {
	return fmt.Sprintf("%s at %s, %s pages (%s)", b.Kind, b.Dir, FormatSize(b.PageSize), b.Reason)
}

// Choose picks the backend w asks for. A forced kind that is unavailable is
// an error naming what is missing; Auto falls back to tmpfs and says why.
func Choose(w Want) (Backend, error) {
	if w.PageSize == 0 {
		w.PageSize = DefaultPageSize()
	}
	if w.Pages == 0 {
		w.Pages = 1
	}
	switch w.Kind {
	case Hugetlbfs:
		return chooseHugetlbfs(w)
	case Tmpfs:
		return chooseTmpfs(w, "forced by configuration")
	case Auto:
		b, err := chooseHugetlbfs(w)
		if err == nil {
			return b, nil
		}
		return chooseTmpfs(w, "fallback: "+err.Error())
	}
	return Backend{}, fmt.Errorf("hugetlb: unknown backend kind %d", w.Kind)
}

func chooseHugetlbfs(w Want) (Backend, error) {
	size := FormatSize(w.PageSize)
	pool, err := PoolFor(w.PageSize)
	if err != nil {
		return Backend{}, err
	}
	if avail := pool.Available(); avail < w.Pages {
		return Backend{}, fmt.Errorf("%w: %d %s pages needed, %d free of %d (raise /proc/sys/vm/nr_hugepages or %s/hugepages-%dkB/nr_hugepages)",
			ErrNoPages, w.Pages, size, avail, pool.Total, sysPages, w.PageSize>>10)
	}
	if w.Dir != "" {
		page, huge, err := falloc.DirBlockSize(w.Dir)
		switch {
		case err != nil:
			return Backend{}, fmt.Errorf("%w: %s: %v", ErrNoMount, w.Dir, err)
		case !huge:
			return Backend{}, fmt.Errorf("%w: %s is not on hugetlbfs", ErrNoMount, w.Dir)
		case page != w.PageSize:
			return Backend{}, fmt.Errorf("%w: %s has %s pages, want %s", ErrNoMount, w.Dir, FormatSize(page), size)
		}
		return Backend{Kind: Hugetlbfs, Dir: w.Dir, PageSize: page, Reason: "directory given by configuration"}, nil
	}
	mounts, err := Mounts()
	if err != nil {
		return Backend{}, err
	}
	var readonly []string
	for _, m := range mounts {
		if m.PageSize != w.PageSize {
			continue
		}
		if !m.Writable {
			readonly = append(readonly, m.Dir)
			continue
		}
		return Backend{Kind: Hugetlbfs, Dir: m.Dir, PageSize: m.PageSize,
			Reason: fmt.Sprintf("%d of %d %s hugepages free", pool.Available(), pool.Total, size)}, nil
	}
	if len(readonly) > 0 {
		return Backend{}, fmt.Errorf("%w: %s hugetlbfs mounts %s are not writable by uid %d",
			ErrNoMount, size, strings.Join(readonly, ", "), os.Getuid())
	}
	return Backend{}, fmt.Errorf("%w: no hugetlbfs mount with %s pages in %s (mount -t hugetlbfs -o pagesize=%s none DIR)",
		ErrNoMount, size, procMounts, strings.ReplaceAll(size, "iB", ""))
}

func chooseTmpfs(w Want, reason string) (Backend, error) {
	dir := DefaultTmpfsDir
	if w.Dir != "" && w.Kind == Tmpfs {
		dir = w.Dir
	}
	if err := unix.Access(dir, unix.W_OK|unix.X_OK); err != nil {
		return Backend{}, fmt.Errorf("%w: %s: %v", ErrNoTmpfs, dir, err)
	}
	// A directory given by configuration must be on tmpfs: on a disk the
	// memory would be a file's pages, written back, and secondaries take
	// a segment only on tmpfs or hugetlbfs.
	var st unix.Statfs_t
	if w.Dir != "" && w.Kind == Tmpfs && (unix.Statfs(dir, &st) != nil || st.Type != unix.TMPFS_MAGIC) {
		return Backend{}, fmt.Errorf("%w: %s is not on tmpfs (file system magic %#x)", ErrNoTmpfs, dir, st.Type)
	}
	return Backend{Kind: Tmpfs, Dir: dir, PageSize: w.PageSize, Reason: reason}, nil
}
