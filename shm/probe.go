package shm

import (
	"fmt"
	"os"
	"sync/atomic"
	"syscall"

	mmap "github.com/edsrzf/mmap-go"

	"github.com/mpmr/mpmr/internal/sys/falloc"
)

// Info is what a segment's header says about it.
type Info struct {
	Path         string `json:"path"`
	Version      uint32 `json:"version"`
	State        string `json:"state"` // "initializing", "ready", "dead"
	Size         uint64 `json:"size"`
	MaxSize      uint64 `json:"max_size"`
	PageSize     uint64 `json:"page_size"`
	Hugetlbfs    bool   `json:"hugetlbfs"`
	Slots        int    `json:"slots"`
	CreatorPID   int    `json:"creator_pid"`
	CreatorUID   int    `json:"creator_uid"`
	CreatorStart uint64 `json:"creator_start"`
}

func stateName(s uint32) string {
	switch s {
	case stateInitializing:
		return "initializing"
	case stateReady:
		return "ready"
	case stateDead:
		return "dead"
	}
	return fmt.Sprintf("state(%d)", s)
}

// Probe reads and validates the header of the segment file at path without
// attaching to it: magic, ABI version, layout (own layout mixed with
// layoutTag), sizes against the file, then state. It returns the header's
// Info together with the first failure; the Info is filled in for ErrNotReady
// and ErrDead, so tools can still describe such a segment.
//
// It never follows a symbolic link and never waits: a FIFO or anything
// else that is not a regular file is refused at once.
func Probe(path string, layoutTag uint32) (Info, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return Info{Path: path}, fmt.Errorf("shm: probe: %w", err)
	}
	defer f.Close()
	return ProbeFile(f, layoutTag)
}

// ProbeFile is Probe of an open file (a claimed one, say, that its name
// may no longer designate).
func ProbeFile(f *os.File, layoutTag uint32) (Info, error) {
	path := f.Name()
	info, err := probeFile(f, layoutTag)
	if err != nil {
		return info, fmt.Errorf("shm: probe %s: %w", path, err)
	}
	return info, nil
}

// probeFile validates the header through a read-only mapping of the first
// backing page, so that no byte past a bad header is ever interpreted.
func probeFile(f *os.File, layoutTag uint32) (Info, error) {
	info := Info{Path: f.Name()}
	st, err := f.Stat()
	if err != nil {
		return info, err
	}
	if !st.Mode().IsRegular() {
		return info, fmt.Errorf("%w: not a regular file (%v)", ErrBadMagic, st.Mode().Type())
	}
	page, huge, err := falloc.BlockSize(int(f.Fd()))
	if err != nil {
		return info, err
	}
	info.Hugetlbfs = huge
	if st.Size() < headerSize {
		return info, fmt.Errorf("%w: %d bytes, header needs %d", ErrTruncated, st.Size(), headerSize)
	}
	m, err := mmap.MapRegion(f, int(page), mmap.RDONLY, 0, 0)
	if err != nil {
		return info, fmt.Errorf("map header: %w", err)
	}
	defer m.Unmap()
	h := headerIn(m)
	magic := atomic.LoadUint64(&h.Magic)
	info.Version = atomic.LoadUint32(&h.Version)
	info.State = stateName(atomic.LoadUint32(&h.State))
	info.Size = atomic.LoadUint64(&h.Size)
	info.MaxSize = atomic.LoadUint64(&h.MaxSize)
	info.PageSize = atomic.LoadUint64(&h.PageSize)
	info.Slots = int(atomic.LoadUint32(&h.Slots))
	info.CreatorPID = int(atomic.LoadUint32(&h.CreatorPID))
	info.CreatorUID = int(atomic.LoadUint32(&h.CreatorUID))
	info.CreatorStart = atomic.LoadUint64(&h.CreatorStart)
	if magic != Magic {
		if allZero(m[:headerSize]) {
			return info, fmt.Errorf("%w: header not written yet", ErrNotReady)
		}
		return info, fmt.Errorf("%w: 0x%016x", ErrBadMagic, magic)
	}
	if info.Version != Version {
		return info, fmt.Errorf("%w: segment has %d, this build %d", ErrVersionMismatch, info.Version, Version)
	}
	if got, want := atomic.LoadUint32(&h.Layout), ownLayout^layoutTag; got != want {
		return info, fmt.Errorf("%w: segment has 0x%08x, this build 0x%08x", ErrLayoutMismatch, got, want)
	}
	switch {
	case info.PageSize != page:
		return info, fmt.Errorf("%w: page size %d, file system has %d", ErrCorrupt, info.PageSize, page)
	case info.Size < headerSize || info.Size%page != 0 || info.MaxSize < info.Size || info.MaxSize%page != 0:
		return info, fmt.Errorf("%w: size 0x%x, max 0x%x", ErrCorrupt, info.Size, info.MaxSize)
	case info.Slots < 1 || info.Slots > MaxSlots || atomic.LoadUint64(&h.ProcsOff) != headerSize:
		return info, fmt.Errorf("%w: %d slots at 0x%x", ErrCorrupt, info.Slots, atomic.LoadUint64(&h.ProcsOff))
	case atomic.LoadUint64(&h.ArenaOff) < headerSize+uint64(info.Slots)*slotSize || atomic.LoadUint64(&h.ArenaOff) >= info.Size:
		return info, fmt.Errorf("%w: arena at 0x%x", ErrCorrupt, atomic.LoadUint64(&h.ArenaOff))
	case uint64(st.Size()) < info.Size:
		return info, fmt.Errorf("%w: file has %d bytes, header says %d", ErrTruncated, st.Size(), info.Size)
	}
	switch s := atomic.LoadUint32(&h.State); s {
	case stateReady:
		return info, nil
	case stateInitializing:
		return info, ErrNotReady
	case stateDead:
		return info, ErrDead
	default:
		return info, fmt.Errorf("%w: state %d", ErrCorrupt, s)
	}
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// MarkDeadFile marks the segment file at path as belonging to an ended
// instance, so that no process attaches to it any more. A new primary does
// this to a predecessor's segment before removing it, for the sake of
// secondaries of the dead instance that still look at it. It refuses files
// without the segment magic.
//
// Like Probe, it never follows a symbolic link and never waits on a FIFO.
func MarkDeadFile(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return fmt.Errorf("shm: mark dead: %w", err)
	}
	defer f.Close()
	return MarkDead(f)
}

// MarkEnded is MarkDead for a segment file whose instance was proven
// ended by its name alone: it marks f (open for writing) dead unless f may
// be a live instance's after all, because it has another name (a hard
// link from another instance's name) or because the creator its header
// names (pid and start time) still runs. It reports whether it marked.
// The header's words are written by whoever may write the segment: they
// are trusted to spare a segment, never to mark one.
func MarkEnded(f *os.File, layoutTag uint32) (bool, error) {
	st, err := f.Stat()
	if err != nil {
		return false, err
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); !ok || sys.Nlink > 1 {
		return false, nil
	}
	if info, _ := ProbeFile(f, layoutTag); Running(info.CreatorPID, info.CreatorStart) {
		return false, nil
	}
	return true, MarkDead(f)
}

// MarkDead is MarkDeadFile of an open file (open for writing).
func MarkDead(f *os.File) error {
	path := f.Name()
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		return fmt.Errorf("shm: mark dead %s: %w: not a regular file", path, ErrBadMagic)
	}
	page, _, err := falloc.BlockSize(int(f.Fd()))
	if err != nil {
		return err
	}
	if st, err := f.Stat(); err != nil || st.Size() < int64(page) {
		return fmt.Errorf("shm: mark dead %s: %w", path, ErrTruncated)
	}
	// hugetlbfs files cannot be written with write(2): go through a map.
	m, err := mmap.MapRegion(f, int(page), mmap.RDWR, 0, 0)
	if err != nil {
		return fmt.Errorf("shm: mark dead %s: %w", path, err)
	}
	defer m.Unmap()
	h := headerIn(m)
	if atomic.LoadUint64(&h.Magic) != Magic {
		return fmt.Errorf("shm: mark dead %s: %w", path, ErrBadMagic)
	}
	atomic.StoreUint32(&h.State, stateDead)
	return nil
}
