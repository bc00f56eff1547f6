// Package instance holds what the primary and secondary runtimes share
// about an instance: where its files live, the description file the primary
// writes for others to find them, the layout tag of the control segment,
// the per-process counters kept in the segment, and the error codes that
// travel over IPC.
package instance

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/sys/mounts"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// File names inside an instance's runtime directory.
const (
	InfoFile        = "instance.json" // Info, written by the primary
	PrimaryLockFile = "primary.lock"  // byte 0 is held by the live primary
	SlotsLockFile   = "slots.lock"    // the process table's liveness locks
	// BackendsFile lists the backend directories where a primary of the
	// instance may have made files, one a line: a primary writes it before
	// it makes any, so that one that dies before it describes itself
	// (InfoFile) is cleaned up after by the next, whichever backend that
	// one chooses.
	BackendsFile = "backends"
)

// Info describes a running (or dead) instance; the primary writes it to
// InfoFile in the runtime directory once the instance is ready.
type Info struct {
	Prefix     string    `json:"prefix"`
	PID        int       `json:"pid"`
	Start      uint64    `json:"start"` // process start time, clock ticks after boot
	Backend    string    `json:"backend"`
	BackendDir string    `json:"backend_dir"`
	PageSize   uint64    `json:"page_size"`
	Segment    string    `json:"segment"`
	LockFile   string    `json:"lock_file"`
	Socket     string    `json:"socket"`
	Created    time.Time `json:"created"`
}

// Dir returns the runtime directory of prefix: override if set, else
// ipc.RuntimeDir.
func Dir(prefix, override string) (string, error) {
	if err := ipc.ValidatePrefix(prefix); err != nil {
		return "", err
	}
	if override != "" {
		return filepath.Join(override, prefix), nil
	}
	return ipc.RuntimeDir(prefix)
}

// Name returns the name the files of instance prefix carry in backend
// directories, which other users and other runtime directories share: the
// prefix, the uid of the instance's user and a hash of the real path of
// its runtime directory dir, such as "myapp.u1000.3f2a9c01b7e4". Two
// instances of one prefix, of two users or in two runtime directories,
// never share a file.
func Name(prefix string, uid int, dir string) string {
	sum := sha256.Sum256([]byte(RealPath(dir)))
	return fmt.Sprintf("%s.u%d.%x", prefix, uid, sum[:6])
}

// PrivateDirName returns a new name for a directory, in a backend
// directory, that holds the files of the instance called name alone: they
// go there when another user holds one of their names in the backend
// directory itself (see primary.Start). It is "mpmr.", name, ".p" and a
// random part nobody can
// foresee (rand.Text's 26 letters and digits, 128 bits), so that nobody
// makes it first.
func PrivateDirName(name string) string {
	return "mpmr." + name + ".p" + strings.ToLower(rand.Text())
}

// IsPrivateDir reports whether base is a name PrivateDirName gives for
// the instance called name.
func IsPrivateDir(base, name string) bool {
	r, ok := strings.CutPrefix(base, "mpmr."+name+".p")
	return ok && len(r) == 26 && strings.Trim(r, "abcdefghijklmnopqrstuvwxyz234567") == ""
}

// IsPrivateDirOf reports whether base is a name PrivateDirName gives for
// an instance of prefix and uid, of any runtime directory.
func IsPrivateDirOf(base, prefix string, uid int) bool {
	i := strings.LastIndex(base, ".p")
	if i < 0 {
		return false
	}
	name, ok := SegmentName(base[:i]+".ctl", prefix, uid)
	return ok && IsPrivateDir(base, name)
}

// HangingMount returns a mount in tab of a file system that might not
// answer (mounts.MayHang) on the directory dir, above it, or on one of the
// names of the instance files called name in it, if there is one: a thread
// that looks there may wait for ever, past any deadline and past SIGKILL.
func HangingMount(tab mounts.Table, dir, name string) *mounts.Entry {
	dir = filepath.Clean(dir)
	for _, m := range tab {
		if mounts.MayHang(m.Type) && (m.Dir == dir || strings.HasPrefix(dir, m.Dir+"/")) {
			return &m
		}
	}
	return MountOnNames(tab, dir, name)
}

// MountOnNames is HangingMount for the instance's names in dir only, for
// a directory reached without asking such a file system (mounts.OpenDir).
func MountOnNames(tab mounts.Table, dir, name string) *mounts.Entry {
	prefix := filepath.Join(dir, "mpmr."+name+".")
	for _, m := range tab {
		if mounts.MayHang(m.Type) && strings.HasPrefix(m.Dir, prefix) {
			return &m
		}
	}
	return nil
}

// SegmentName returns the name (see Name) that the control segment file
// at path carries, if it is a segment's name of an instance of prefix and
// uid, of any runtime directory.
func SegmentName(path, prefix string, uid int) (string, bool) {
	base := filepath.Base(path)
	rest, isSeg := strings.CutPrefix(base, "mpmr.")
	name, isCtl := strings.CutSuffix(rest, ".ctl")
	hash, ours := strings.CutPrefix(name, fmt.Sprintf("%s.u%d.", prefix, uid))
	if !isSeg || !isCtl || !ours || len(hash) != 12 || strings.Trim(hash, "0123456789abcdef") != "" {
		return "", false
	}
	return name, true
}

// RealPath returns dir, absolute, with symbolic links resolved as far as
// it exists. A relative dir is taken from the working directory first:
// resolved as it is, it would stay relative, and name the instance
// otherwise than its full path does.
func RealPath(dir string) string {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return dir
	}
	if r, err := filepath.EvalSymlinks(abs); err == nil {
		return r
	}
	if r, err := filepath.EvalSymlinks(filepath.Dir(abs)); err == nil {
		return filepath.Join(r, filepath.Base(abs))
	}
	return abs
}

// SegmentPath is the control segment file of the instance called name
// (see Name) in a backend directory.
func SegmentPath(backendDir, name string) string {
	return filepath.Join(backendDir, "mpmr."+name+".ctl")
}

// Files lists the files of the instance called name in a backend
// directory: its segment, a lock file beside it, its memseg lists'
// backing files (see hugetlb.FileName) and its primary's life file.
func Files(backendDir, name string) []string {
	ents, err := os.ReadDir(backendDir)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range ents {
		rest, ok := strings.CutPrefix(e.Name(), "mpmr."+name+".")
		if !ok {
			continue
		}
		n, list := strings.CutPrefix(rest, "msl")
		if rest == "ctl" || rest == "ctl.lock" || rest == "live" || list && n != "" && strings.Trim(n, "0123456789") == "" {
			out = append(out, filepath.Join(backendDir, e.Name()))
		}
	}
	return out
}

// WriteInfo writes info to dir atomically.
func WriteInfo(dir string, info Info) error {
	b, err := json.MarshalIndent(info, "", "  ")
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, InfoFile+".tmp")
	if err := os.WriteFile(tmp, append(b, '\n'), 0o600); err != nil {
		return fmt.Errorf("instance: write %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, InfoFile)); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("instance: %w", err)
	}
	return nil
}

// WriteInfoIn writes info to the runtime directory d atomically, through
// its descriptor.
func WriteInfoIn(d *ipc.RunDir, info Info) error {
	b, err := json.MarshalIndent(info, "", "  ")
	if err != nil {
		return err
	}
	return writeIn(d, InfoFile, append(b, '\n'))
}

// ReadInfoIn reads the description in the runtime directory d, through
// its descriptor: the file must be a regular file of the directory's
// owner or root (else ipc.ErrPermission).
func ReadInfoIn(d *ipc.RunDir) (Info, error) {
	var info Info
	b, err := readIn(d, InfoFile)
	if err != nil {
		return info, err
	}
	if err := json.Unmarshal(b, &info); err != nil {
		return info, fmt.Errorf("instance: %s: %w", filepath.Join(d.Path(), InfoFile), err)
	}
	return info, nil
}

// writeIn writes the file name of the runtime directory d atomically (a
// temporary file renamed), through its descriptor.
func writeIn(d *ipc.RunDir, name string, b []byte) error {
	tmp := name + ".tmp"
	f, err := d.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("instance: write %w", err)
	}
	_, err = f.Write(b)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = d.Rename(tmp, name)
	}
	if err != nil {
		d.Remove(tmp)
		return fmt.Errorf("instance: write %s: %w", filepath.Join(d.Path(), name), err)
	}
	return nil
}

// readIn reads the file name of the runtime directory d, through its
// descriptor (see ReadInfoIn), up to maxInfo bytes.
func readIn(d *ipc.RunDir, name string) ([]byte, error) {
	f, err := d.OpenFile(name, os.O_RDONLY, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxInfo+1))
	if err == nil && len(b) > maxInfo {
		err = fmt.Errorf("longer than %d bytes", maxInfo)
	}
	if err != nil {
		return nil, fmt.Errorf("instance: %s: %w", f.Name(), err)
	}
	return b, nil
}

// maxInfo bounds the description file read.
const maxInfo = 64 << 10

// WriteBackendsIn records dirs in BackendsFile in the runtime directory d,
// atomically, through its descriptor.
func WriteBackendsIn(d *ipc.RunDir, dirs []string) error {
	var b []byte
	for _, dir := range dirs {
		if dir == "" || strings.ContainsRune(dir, '\n') {
			return fmt.Errorf("instance: backend directory %q cannot be recorded", dir)
		}
		b = append(append(b, dir...), '\n')
	}
	return writeIn(d, BackendsFile, b)
}

// ReadBackendsIn reads the backend directories recorded in the runtime
// directory d (see BackendsFile), through its descriptor, as ReadInfoIn
// reads the description.
func ReadBackendsIn(d *ipc.RunDir) ([]string, error) {
	b, err := readIn(d, BackendsFile)
	if err != nil {
		return nil, err
	}
	var dirs []string
	for _, line := range strings.Split(string(b), "\n") {
		if line != "" {
			dirs = append(dirs, line)
		}
	}
	return dirs, nil
}

// ReadInfo reads the description in dir.
func ReadInfo(dir string) (Info, error) {
	var info Info
	b, err := os.ReadFile(filepath.Join(dir, InfoFile))
	if err != nil {
		return info, err
	}
	if err := json.Unmarshal(b, &info); err != nil {
		return info, fmt.Errorf("instance: %s: %w", filepath.Join(dir, InfoFile), err)
	}
	return info, nil
}

// LayoutTag is the layout tag every process of this build passes to the
// control segment: a hash of the shared structs of every layer.
var LayoutTag = func() uint32 {
	var d []string
	d = append(d, cache.Layout()...)
	d = append(d, hugetlb.Layout()...)
	d = append(d, verbs.Layout()...)
	d = append(d, countersLayout()...)
	return shm.LayoutHash(d...)
}()

// Errors that travel between processes, by code.
var (
	// ErrPrimaryGone means the primary has ended: requests to it fail at
	// once. Keys already cached keep resolving.
	ErrPrimaryGone = errors.New("mpmr: the primary has gone")
	// ErrDropped means the primary dropped this secondary: it stopped
	// following memory changes (it was stopped or too slow to answer, or
	// its connection ended while the primary lives). Its data memory is
	// unmapped and requests fail; attach again to carry on.
	ErrDropped = errors.New("mpmr: the primary dropped this secondary (it did not follow a memory change)")
	// ErrPrimaryRunning means another live primary serves the prefix.
	ErrPrimaryRunning = errors.New("mpmr: a primary is already running for this prefix")
	// ErrNoPrimary means no primary serves the prefix.
	ErrNoPrimary = errors.New("mpmr: no primary is running for this prefix")
	// ErrABI means the two processes were built with different protocol
	// or layout versions.
	ErrABI = errors.New("mpmr: primary and secondary are incompatible builds")
	// ErrClosing means the primary is shutting down.
	ErrClosing = errors.New("mpmr: the primary is closing")
	// ErrNotAttached means a request came before the attach handshake.
	ErrNotAttached = errors.New("mpmr: the peer has not attached")
)

func init() {
	for code, err := range map[string]error{
		"no-memory":       cache.ErrNoMemory,
		"external-memory": cache.ErrExternalMemory,
		"cache-closed":    cache.ErrClosed,
		"abi":             ErrABI,
		"closing":         ErrClosing,
		"not-attached":    ErrNotAttached,
		"no-free-run":     hugetlb.ErrNoFreeRun,
		"no-hugepages":    hugetlb.ErrNoHugepages,
		"no-resources":    verbs.ErrNoResources,
		"not-mapped":      verbs.ErrNotMapped,
	} {
		ipc.RegisterError(code, err)
	}
}
