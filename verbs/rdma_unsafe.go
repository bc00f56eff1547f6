//go:build rdma

package verbs

/*
#cgo LDFLAGS: -libverbs
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <infiniband/verbs.h>

// ibv_get_device_list and ibv_reg_mr are macros in recent headers; cgo
// calls functions.
static struct ibv_device **mpmr_get_device_list(int *n) { return ibv_get_device_list(n); }
static struct ibv_device *mpmr_device_at(struct ibv_device **list, int i) { return list[i]; }
static struct ibv_mr *mpmr_reg_mr(struct ibv_pd *pd, uintptr_t addr, size_t len, int access) {
	return ibv_reg_mr(pd, (void *)addr, len, access);
}
static int mpmr_cmd_fd(struct ibv_context *ctx) { return ctx->cmd_fd; }
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"syscall"
)

// RDMADevice is an rdma-core device context, opened by name (OpenRDMA, the
// primary) or imported from another process's command fd (ImportDevice, a
// secondary). It is safe for concurrent use.
type RDMADevice struct {
	mu       sync.Mutex
	ctx      *C.struct_ibv_context
	name     string
	imported bool
	pds      map[*RDMAPD]struct{}
}

// RDMAPD is a protection domain of an RDMADevice, allocated (AllocPD) or
// imported (ImportPD). It is safe for concurrent use.
type RDMAPD struct {
	dev      *RDMADevice
	mu       sync.Mutex
	pd       *C.struct_ibv_pd
	imported bool
	mrs      map[uint32]rdmaMR // by MR handle
}

type rdmaMR struct {
	mr       *C.struct_ibv_mr
	imported bool
}

// rdmaError turns a failed verbs call's errno into the package's sentinels.
func rdmaError(what string, err error) error {
	var errno syscall.Errno
	if !errors.As(err, &errno) || errno == 0 {
		return fmt.Errorf("verbs: %s failed without an errno", what)
	}
	var s error
	switch errno {
	case syscall.ENOMEM, syscall.ENOSPC, syscall.EAGAIN:
		s = ErrNoResources
	case syscall.EPERM, syscall.EACCES:
		s = ErrPermission
	case syscall.EFAULT:
		s = ErrNotMapped
	case syscall.EINVAL:
		s = ErrBadRange
	case syscall.ENODEV, syscall.ENOENT, syscall.ENOSYS:
		s = ErrNoDevice
	default:
		return fmt.Errorf("verbs: %s: %w", what, errno)
	}
	return fmt.Errorf("verbs: %s: %w: %w", what, s, errno)
}

// RDMADevices lists the names of the RDMA devices ibv_get_device_list
// finds. A machine without RDMA support gives an empty list.
func RDMADevices() ([]string, error) {
	var n C.int
	list, err := C.mpmr_get_device_list(&n)
	if list == nil {
		var errno syscall.Errno
		if errors.As(err, &errno) && errno == syscall.ENOSYS {
			return nil, nil // no kernel support: no devices
		}
		return nil, rdmaError("ibv_get_device_list", err)
	}
	defer C.ibv_free_device_list(list)
	names := make([]string, 0, int(n))
	for i := range int(n) {
		names = append(names, C.GoString(C.ibv_get_device_name(C.mpmr_device_at(list, C.int(i)))))
	}
	return names, nil
}

// OpenRDMA opens the RDMA device called name (as ibv_devices lists it).
func OpenRDMA(name string) (*RDMADevice, error) {
	var n C.int
	list, err := C.mpmr_get_device_list(&n)
	if list == nil {
		return nil, rdmaError(fmt.Sprintf("open %q: ibv_get_device_list", name), err)
	}
	defer C.ibv_free_device_list(list)
	var names []string
	for i := range int(n) {
		dev := C.mpmr_device_at(list, C.int(i))
		got := C.GoString(C.ibv_get_device_name(dev))
		if got != name {
			names = append(names, got)
			continue
		}
		ctx, err := C.ibv_open_device(dev)
		if ctx == nil {
			return nil, rdmaError(fmt.Sprintf("open %q: ibv_open_device", name), err)
		}
		return &RDMADevice{ctx: ctx, name: name, pds: make(map[*RDMAPD]struct{})}, nil
	}
	return nil, fmt.Errorf("verbs: open %q: %w (devices: %q)", name, ErrNoDevice, names)
}

func openRDMA(name string, _ OpenOptions) (Device, error) {
	d, err := OpenRDMA(name)
	if err != nil {
		return nil, err
	}
	return d, nil
}

// ImportDevice makes a device context from another process's command fd
// (the primary's CmdFD, received over a unix socket with SCM_RIGHTS). The
// device takes cmdFD over: Close closes it.
func ImportDevice(cmdFD int) (*RDMADevice, error) {
	ctx, err := C.ibv_import_device(C.int(cmdFD))
	if ctx == nil {
		return nil, rdmaError(fmt.Sprintf("ibv_import_device(fd %d)", cmdFD), err)
	}
	name := C.GoString(C.ibv_get_device_name(ctx.device))
	return &RDMADevice{ctx: ctx, name: name, imported: true, pds: make(map[*RDMAPD]struct{})}, nil
}

// Name returns the device's name.
func (d *RDMADevice) Name() string { return d.name }

// CmdFD returns the context's command fd, which a secondary needs to
// import the device. Send a duplicate: the device keeps its own.
func (d *RDMADevice) CmdFD() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ctx == nil {
		return -1
	}
	return int(C.mpmr_cmd_fd(d.ctx))
}

// AllocPD allocates a protection domain.
func (d *RDMADevice) AllocPD() (PD, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ctx == nil {
		return nil, fmt.Errorf("verbs: %s: alloc PD: %w", d.name, ErrClosed)
	}
	pd, err := C.ibv_alloc_pd(d.ctx)
	if pd == nil {
		return nil, rdmaError(d.name+": ibv_alloc_pd", err)
	}
	return d.addPD(pd, false), nil
}

// ImportPD imports the protection domain with the given handle (the
// primary's (*RDMAPD).Handle) into an imported device.
func (d *RDMADevice) ImportPD(handle uint32) (*RDMAPD, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ctx == nil {
		return nil, fmt.Errorf("verbs: %s: import PD %d: %w", d.name, handle, ErrClosed)
	}
	pd, err := C.ibv_import_pd(d.ctx, C.uint32_t(handle))
	if pd == nil {
		return nil, rdmaError(fmt.Sprintf("%s: ibv_import_pd(%d)", d.name, handle), err)
	}
	return d.addPD(pd, true), nil
}

// addPD is called with d.mu held.
func (d *RDMADevice) addPD(pd *C.struct_ibv_pd, imported bool) *RDMAPD {
	p := &RDMAPD{dev: d, pd: pd, imported: imported, mrs: make(map[uint32]rdmaMR)}
	d.pds[p] = struct{}{}
	return p
}

// Close releases every PD (and its MRs) and the context. It is idempotent.
func (d *RDMADevice) Close() error {
	d.mu.Lock()
	pds := make([]*RDMAPD, 0, len(d.pds))
	for p := range d.pds {
		pds = append(pds, p)
	}
	d.mu.Unlock()
	var errs []error
	for _, p := range pds {
		errs = append(errs, p.Close())
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ctx != nil {
		if rc, err := C.ibv_close_device(d.ctx); rc != 0 {
			errs = append(errs, rdmaError(d.name+": ibv_close_device", err))
		}
		d.ctx = nil
	}
	return errors.Join(errs...)
}

// Handle returns the PD's kernel handle, what ImportPD takes.
func (p *RDMAPD) Handle() uint32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pd == nil {
		return 0
	}
	return uint32(p.pd.handle)
}

// verbsAccess translates Access to ibv_access_flags.
func verbsAccess(a Access) C.int {
	var f C.int
	if a&AccessLocalWrite != 0 {
		f |= C.IBV_ACCESS_LOCAL_WRITE
	}
	if a&AccessRemoteRead != 0 {
		f |= C.IBV_ACCESS_REMOTE_READ
	}
	if a&AccessRemoteWrite != 0 {
		f |= C.IBV_ACCESS_REMOTE_WRITE
	}
	if a&AccessRelaxedOrdering != 0 {
		f |= C.IBV_ACCESS_RELAXED_ORDERING
	}
	return f
}

func fromVerbs(mr *C.struct_ibv_mr, access Access) MR {
	return MR{
		Addr:   uintptr(mr.addr),
		Len:    uintptr(mr.length),
		LKey:   uint32(mr.lkey),
		RKey:   uint32(mr.rkey),
		Handle: uint32(mr.handle),
		Access: access,
	}
}

// RegMR registers [addr, addr+length) with ibv_reg_mr.
func (p *RDMAPD) RegMR(addr, length uintptr, access Access) (MR, error) {
	if length == 0 || addr+length < addr {
		return MR{}, fmt.Errorf("verbs: reg_mr [0x%x, +0x%x): %w", addr, length, ErrBadRange)
	}
	if err := access.check(); err != nil {
		return MR{}, fmt.Errorf("verbs: reg_mr [0x%x, 0x%x): %w", addr, addr+length, err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pd == nil {
		return MR{}, fmt.Errorf("verbs: reg_mr [0x%x, 0x%x): %w", addr, addr+length, ErrClosed)
	}
	mr, err := C.mpmr_reg_mr(p.pd, C.uintptr_t(addr), C.size_t(length), verbsAccess(access))
	if mr == nil {
		return MR{}, rdmaError(fmt.Sprintf("reg_mr [0x%x, 0x%x)", addr, addr+length), err)
	}
	p.mrs[uint32(mr.handle)] = rdmaMR{mr: mr}
	return fromVerbs(mr, access), nil
}

// ImportMR imports the MR with the given handle (the primary's MR.Handle)
// into pd, an imported PD. The MR's keys are the primary's. Give it back
// with pd.DeregMR, which unimports it and leaves the primary's
// registration alone. The returned MR's Access is unknown to the importer
// and left 0.
func ImportMR(pd *RDMAPD, handle uint32) (MR, error) {
	pd.mu.Lock()
	defer pd.mu.Unlock()
	if pd.pd == nil {
		return MR{}, fmt.Errorf("verbs: import MR %d: %w", handle, ErrClosed)
	}
	mr, err := C.ibv_import_mr(pd.pd, C.uint32_t(handle))
	if mr == nil {
		return MR{}, rdmaError(fmt.Sprintf("ibv_import_mr(%d)", handle), err)
	}
	pd.mrs[uint32(mr.handle)] = rdmaMR{mr: mr, imported: true}
	return fromVerbs(mr, 0), nil
}

// DeregMR deregisters an MR this PD registered (ibv_dereg_mr) or unimports
// one it imported (ibv_unimport_mr).
func (p *RDMAPD) DeregMR(m MR) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	r, ok := p.mrs[m.Handle]
	if !ok || uint32(r.mr.lkey) != m.LKey {
		return fmt.Errorf("verbs: dereg_mr handle %d key 0x%x: %w: not an MR of this PD", m.Handle, m.LKey, ErrInvalidKey)
	}
	return p.releaseLocked(m.Handle, r)
}

// releaseLocked is called with p.mu held.
func (p *RDMAPD) releaseLocked(handle uint32, r rdmaMR) error {
	delete(p.mrs, handle)
	if r.imported {
		C.ibv_unimport_mr(r.mr)
		return nil
	}
	if rc := C.ibv_dereg_mr(r.mr); rc != 0 {
		return fmt.Errorf("verbs: ibv_dereg_mr handle %d: %w", handle, syscall.Errno(rc))
	}
	return nil
}

// Close releases the PD's remaining MRs, then deallocates (or unimports)
// the PD. It is idempotent.
func (p *RDMAPD) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pd == nil {
		return nil
	}
	var errs []error
	for h, r := range p.mrs {
		errs = append(errs, p.releaseLocked(h, r))
	}
	if p.imported {
		C.ibv_unimport_pd(p.pd)
	} else if rc := C.ibv_dealloc_pd(p.pd); rc != 0 {
		errs = append(errs, fmt.Errorf("verbs: ibv_dealloc_pd: %w", syscall.Errno(rc)))
	}
	p.pd = nil
	p.dev.mu.Lock()
	delete(p.dev.pds, p)
	p.dev.mu.Unlock()
	return errors.Join(errs...)
}
