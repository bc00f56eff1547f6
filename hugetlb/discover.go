package hugetlb

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/sys/mounts"
)

// Discovery errors. Choose wraps them with what exactly is missing.
var (
	ErrNoMount = errors.New("hugetlb: no usable hugetlbfs mount")
	ErrNoPages = errors.New("hugetlb: not enough free hugepages")
	ErrNoTmpfs = errors.New("hugetlb: tmpfs directory unusable")
)

// Sources of system information; tests point them elsewhere.
var (
	procMounts  = "/proc/mounts"
	procMeminfo = "/proc/meminfo"
	sysPages    = "/sys/kernel/mm/hugepages"
)

// DefaultTmpfsDir is where the tmpfs backend keeps its files.
const DefaultTmpfsDir = "/dev/shm"

// Mount is a hugetlbfs mount point.
type Mount struct {
	Dir      string
	PageSize uint64
	Writable bool // this process may create files in it
}

// Pool is the kernel's pool of hugepages of one size.
type Pool struct {
	PageSize uint64
	Total    uint64 // nr_hugepages
	Free     uint64 // free_hugepages, reserved ones included
	Reserved uint64 // resv_hugepages: promised to mappings, not yet used
}

// Available is how many pages a new allocation can still get.
func (p Pool) Available() uint64 {
	if p.Free < p.Reserved {
		return 0
	}
	return p.Free - p.Reserved
}

// DefaultPageSize returns the system's default hugepage size (Hugepagesize
// in /proc/meminfo), or 2 MiB if it cannot be read.
func DefaultPageSize() uint64 {
	b, err := os.ReadFile(procMeminfo)
	if err == nil {
		for line := range bytes.Lines(b) {
			if v, ok := bytes.CutPrefix(line, []byte("Hugepagesize:")); ok {
				f := bytes.Fields(v)
				if n, err := strconv.ParseUint(string(f[0]), 10, 64); err == nil && len(f) == 2 && string(f[1]) == "kB" {
					return n << 10
				}
			}
		}
	}
	return 2 << 20
}

// Mounts lists the hugetlbfs mounts in /proc/mounts with their page sizes
// (the pagesize= option, else the default hugepage size).
func Mounts() ([]Mount, error) {
	f, err := os.Open(procMounts)
	if err != nil {
		return nil, fmt.Errorf("hugetlb: %w", err)
	}
	defer f.Close()
	var out []Mount
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 4 || fields[2] != "hugetlbfs" {
			continue
		}
		m := Mount{Dir: mounts.Unescape(fields[1]), PageSize: DefaultPageSize()}
		for _, opt := range strings.Split(fields[3], ",") {
			if v, ok := strings.CutPrefix(opt, "pagesize="); ok {
				if n, err := ParseSize(v); err == nil {
					m.PageSize = n
				}
			}
		}
		m.Writable = unix.Access(m.Dir, unix.W_OK|unix.X_OK) == nil
		out = append(out, m)
	}
	return out, sc.Err()
}

// Pools reads the hugepage pools from /sys/kernel/mm/hugepages.
func Pools() ([]Pool, error) {
	ents, err := os.ReadDir(sysPages)
	if err != nil {
		return nil, fmt.Errorf("hugetlb: %w", err)
	}
	var out []Pool
	for _, e := range ents {
		kb, ok := strings.CutPrefix(e.Name(), "hugepages-")
		if !ok {
			continue
		}
		n, err := strconv.ParseUint(strings.TrimSuffix(kb, "kB"), 10, 64)
		if err != nil {
			continue
		}
		dir := filepath.Join(sysPages, e.Name())
		out = append(out, Pool{
			PageSize: n << 10,
			Total:    readCount(dir, "nr_hugepages"),
			Free:     readCount(dir, "free_hugepages"),
			Reserved: readCount(dir, "resv_hugepages"),
		})
	}
	return out, nil
}

// PoolFor returns the pool of the given page size.
func PoolFor(pageSize uint64) (Pool, error) {
	pools, err := Pools()
	if err != nil {
		return Pool{}, err
	}
	for _, p := range pools {
		if p.PageSize == pageSize {
			return p, nil
		}
	}
	return Pool{}, fmt.Errorf("%w: the kernel has no %s hugepage pool", ErrNoPages, FormatSize(pageSize))
}

func readCount(dir, name string) uint64 {
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	return n
}

// ParseSize parses sizes such as "2M", "2MB", "1G", "2048k" or "4096".
func ParseSize(s string) (uint64, error) {
	t := strings.ToUpper(strings.TrimSpace(s))
	t = strings.TrimSuffix(strings.TrimSuffix(t, "IB"), "B")
	shift := 0
	if t != "" {
		switch t[len(t)-1] {
		case 'K':
			shift = 10
		case 'M':
			shift = 20
		case 'G':
			shift = 30
		case 'T':
			shift = 40
		}
		if shift != 0 {
			t = t[:len(t)-1]
		}
	}
	n, err := strconv.ParseUint(t, 10, 64)
	if err != nil || n > (1<<63)>>shift {
		return 0, fmt.Errorf("hugetlb: bad size %q", s)
	}
	return n << shift, nil
}

// FormatSize prints a byte count with a binary unit when it divides evenly.
func FormatSize(n uint64) string {
	for _, u := range []struct {
		shift uint
		name  string
	}{{40, "TiB"}, {30, "GiB"}, {20, "MiB"}, {10, "KiB"}} {
		if n >= 1<<u.shift && n%(1<<u.shift) == 0 {
			return strconv.FormatUint(n>>u.shift, 10) + " " + u.name
		}
	}
	return strconv.FormatUint(n, 10) + " B"
}
