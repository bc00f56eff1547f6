package verbs

import (
	"encoding/binary"
	"fmt"
	"log/slog"
	"strconv"
	"strings"

	"github.com/mpmr/mpmr/shm"
)

// Access is a set of rights an MR grants, and the rights an operation
// needs. Reading local memory needs no right.
type Access uint32

// Access flags, as in ibv_access_flags (the values differ; the rdma backend
// translates).
const (
	// AccessLocalWrite lets the device write the memory (receives, the
	// destination of a Copy).
	AccessLocalWrite Access = 1 << iota
	// AccessRemoteRead lets a peer read the memory with RDMA read.
	AccessRemoteRead
	// AccessRemoteWrite lets a peer write the memory; it needs
	// AccessLocalWrite too.
	AccessRemoteWrite
	// AccessRelaxedOrdering lets the device reorder its PCIe writes. It is
	// a hint, not a right: Validate ignores it in what an operation needs.
	AccessRelaxedOrdering

	accessAll = AccessLocalWrite | AccessRemoteRead | AccessRemoteWrite | AccessRelaxedOrdering
)

func (a Access) String() string {
	if a == 0 {
		return "read-only"
	}
	var parts []string
	for _, f := range []struct {
		bit  Access
		name string
	}{
		{AccessLocalWrite, "local-write"},
		{AccessRemoteRead, "remote-read"},
		{AccessRemoteWrite, "remote-write"},
		{AccessRelaxedOrdering, "relaxed-ordering"},
	} {
		if a&f.bit != 0 {
			parts = append(parts, f.name)
		}
	}
	if rest := a &^ accessAll; rest != 0 {
		parts = append(parts, fmt.Sprintf("0x%x", uint32(rest)))
	}
	return strings.Join(parts, "|")
}

// MarshalText names the flags as String does, for JSON.
func (a Access) MarshalText() ([]byte, error) { return []byte(a.String()), nil }

// UnmarshalText reads what MarshalText wrote.
func (a *Access) UnmarshalText(b []byte) error {
	var v Access
	if string(b) != "read-only" {
		for _, part := range strings.Split(string(b), "|") {
			switch part {
			case "local-write":
				v |= AccessLocalWrite
			case "remote-read":
				v |= AccessRemoteRead
			case "remote-write":
				v |= AccessRemoteWrite
			case "relaxed-ordering":
				v |= AccessRelaxedOrdering
			default:
				n, err := strconv.ParseUint(strings.TrimPrefix(part, "0x"), 16, 32)
				if err != nil || !strings.HasPrefix(part, "0x") {
					return fmt.Errorf("verbs: unknown access flag %q", part)
				}
				v |= Access(n)
			}
		}
	}
	*a = v
	return nil
}

// check validates the access flags of a registration.
func (a Access) check() error {
	if a&^accessAll != 0 {
		return fmt.Errorf("%w: unknown bits 0x%x", ErrBadAccess, uint32(a&^accessAll))
	}
	if a&AccessRemoteWrite != 0 && a&AccessLocalWrite == 0 {
		return fmt.Errorf("%w: remote write needs local write", ErrBadAccess)
	}
	return nil
}

// InvalidKey (0xFFFFFFFF) is never a valid key; the cache uses it for "no
// key" (UINT32_MAX in DPDK's drivers). It reads the same in either byte order.
const InvalidKey uint32 = 0xFFFFFFFF

// MR is a registered memory region as a registration returns it. It is a
// plain value: copying it is fine, and DeregMR takes it back.
type MR struct {
	Addr uintptr `json:"addr"`
	Len  uintptr `json:"len"`
	// LKey and RKey are in host byte order (see KeyToBE).
	LKey uint32 `json:"lkey"`
	RKey uint32 `json:"rkey"`
	// Handle names the MR to the device: the table slot for the soft
	// device, the kernel's MR handle (what ImportMR takes) for rdma.
	Handle uint32 `json:"handle"`
	Access Access `json:"access"`
}

// End returns the first address past the MR.
func (m MR) End() uintptr { return m.Addr + m.Len }

func (m MR) String() string {
	return fmt.Sprintf("[0x%x, 0x%x) lkey=0x%x rkey=0x%x handle=%d %s",
		m.Addr, m.End(), m.LKey, m.RKey, m.Handle, m.Access)
}

// Device is an opened device. Implementations are safe for concurrent use.
type Device interface {
	// Name returns the device's name ("soft", "mlx5_0", ...).
	Name() string
	// AllocPD allocates a protection domain.
	AllocPD() (PD, error)
	// Close releases the device and everything allocated from it. It is
	// idempotent.
	Close() error
}

// PD is a protection domain: the scope of the MRs registered through it.
// Implementations are safe for concurrent use.
type PD interface {
	// RegMR registers [addr, addr+length) with the given rights and
	// returns the MR with its keys.
	RegMR(addr, length uintptr, access Access) (MR, error)
	// DeregMR deregisters an MR this PD registered; its keys stop working
	// at once.
	DeregMR(mr MR) error
	// Close deregisters what is left and releases the PD. It is idempotent.
	Close() error
}

// Trimmer is implemented by the PDs of devices that can take part of an
// MR's range away while the rest stays registered (the soft device). The
// MR cache uses it when a free takes some of an MR's pages and leaves the
// others: without it (rdma-core), the MR keeps covering — and on hardware
// pinning — the freed pages until all its pages are freed, as in DPDK.
type Trimmer interface {
	TrimMR(mr MR, addr, length uintptr) error
}

// SoftName is the name Open knows the soft device by.
const SoftName = "soft"

// OpenOptions configure Open.
type OpenOptions struct {
	// Segment is the control segment the soft device lives in (required
	// for "soft"). Its owner creates the device; any other process
	// attaches to it.
	Segment *shm.Segment
	// Soft configures a soft device that Open creates.
	Soft SoftOptions
	// Logger receives diagnostics. Default slog.Default(); Soft.Logger,
	// when set, wins for the soft device.
	Logger *slog.Logger
}

// Open opens a device by name. "soft" needs o.Segment: in the segment's
// owner it creates the soft device (CreateSoft) unless the segment already
// has one, anywhere else it attaches (AttachSoft). Any other name is an
// rdma-core device, which needs a build with the "rdma" tag; without it
// Open fails with ErrNoDevice.
func Open(name string, o OpenOptions) (Device, error) {
	if name != SoftName {
		return openRDMA(name, o)
	}
	if o.Segment == nil {
		return nil, fmt.Errorf("verbs: open %q: %w: OpenOptions.Segment is required", name, ErrNoDevice)
	}
	if o.Segment.Owner() && o.Segment.Root(shm.RootDevice) == 0 {
		so := o.Soft
		if so.Logger == nil {
			so.Logger = o.Logger
		}
		return CreateSoft(o.Segment, so)
	}
	return AttachSoft(o.Segment)
}

// KeyToBE converts a key from host order (how this package and the cache
// keep keys) to big-endian, the order a hardware descriptor wants.
func KeyToBE(k uint32) uint32 {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], k)
	return binary.NativeEndian.Uint32(b[:])
}

// KeyFromBE converts a big-endian key read from a descriptor to host order.
func KeyFromBE(k uint32) uint32 {
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], k)
	return binary.BigEndian.Uint32(b[:])
}
