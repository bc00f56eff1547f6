// Package verbs is the project's door to an RDMA device: open a device by
// name, allocate a protection domain (PD), register and deregister memory
// regions (MRs). A registration returns the keys (lkey, rkey) that every
// descriptor the MR cache builds carries.
//
// Two backends implement Device:
//
//   - The soft device ("soft", the default) is a software HCA whose state
//     lives in the shared control segment (shm.RootDevice points at it). The
//     primary creates it with CreateSoft, every other process attaches with
//     AttachSoft. It checks keys the way hardware would: Validate checks a
//     scatter-gather element against the MR table (key live, range inside the
//     MR, access allowed) and reports a failure as a completion error; Copy
//     is a loopback DMA between two validated elements. This is how the rest
//     of the project proves it never hands out a stale or wrong key.
//   - The rdma-core backend (build tag "rdma", cgo against libibverbs) opens
//     a real device; secondaries import the primary's device context, PD and
//     MRs with ImportDevice, (*RDMADevice).ImportPD and ImportMR.
//
// # Keys
//
// A soft key is index<<8 | variant: the index of the MR's slot in the table
// and an 8-bit variant (1..255) that changes every time the slot is reused,
// the way mlx5 builds mkeys. A key therefore never validates once its MR is
// deregistered, even after its slot holds a newer registration. Free slots
// are reused oldest first, so a variant comes round again only after 255
// reuses of that very slot. No backend hands out 0 or InvalidKey.
//
// Keys are in host byte order everywhere in this package and in the MR
// cache. A hardware descriptor wants the lkey big-endian (the DPDK drivers
// store rte_cpu_to_be_32(lkey)); convert with KeyToBE when writing a
// descriptor and KeyFromBE when reading one.
//
// # Processes
//
// Only the process that created the soft device (the segment owner) may
// register and deregister; the PDs of an attached Soft return ErrPermission.
// Every process may validate, copy and read the counters, and sees a
// registration or deregistration the moment the owner's call returns:
// deregistering invalidates the key for every process at once.
package verbs
