// Package hugetlb finds hugepage memory and manages the shared data memory
// that applications put their buffers in.
//
// Discovery reads /proc/mounts for hugetlbfs mounts and
// /sys/kernel/mm/hugepages for the page pools, and Choose picks a backend:
// hugetlbfs when a writable mount of the wanted page size has enough free
// pages, else tmpfs under /dev/shm with the same page granularity. A caller
// can force either; the chosen Backend says which and why.
package hugetlb
