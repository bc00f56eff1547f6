// Package affinity is the door to the kernel's CPU affinity of threads.
package affinity

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// Usable returns the CPUs the calling thread may run on, in order.
func Usable() ([]int, error) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return nil, err
	}
	cpus := make([]int, 0, set.Count())
	for i := range len(set) * 64 {
		if set.IsSet(i) {
			cpus = append(cpus, i)
		}
	}
	return cpus, nil
}

// Pin keeps the calling thread on the CPU it is running on until Release
// gives it back the CPUs it had. The caller locks its goroutine to the
// thread (runtime.LockOSThread) first, and unlocks it only once Release
// succeeded: a thread left bound to one CPU must run no other goroutine.
type Pin struct {
	home  unix.CPUSet // the thread's CPUs before Here
	cpu   int
	moved bool // Here narrowed the thread's CPUs
}

// Here binds the calling thread to the CPU it is running on, unless it may
// run on that one only already, and remembers which (CPU).
func (p *Pin) Here() error {
	*p = Pin{}
	if err := unix.SchedGetaffinity(0, &p.home); err != nil {
		return err
	}
	var cpu uint32
	if _, _, e := unix.RawSyscall(unix.SYS_GETCPU, uintptr(unsafe.Pointer(&cpu)), 0, 0); e != 0 {
		return e
	}
	p.cpu = int(cpu)
	if p.home.Count() == 1 && p.home.IsSet(p.cpu) {
		return nil
	}
	var one unix.CPUSet
	one.Set(p.cpu)
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		return err
	}
	p.moved = true
	return nil
}

// CPU is the CPU Here bound the thread to.
func (p *Pin) CPU() int { return p.cpu }

// Release gives the thread the CPUs it had before Here. If the kernel
// refuses them (its cpuset changed meanwhile and shares none of them), it
// asks for every CPU, which the kernel narrows to those the cpuset allows;
// it fails only if that is refused too, and the thread then stays bound.
func (p *Pin) Release() error {
	if !p.moved {
		return nil
	}
	err := unix.SchedSetaffinity(0, &p.home)
	if err != nil {
		var all unix.CPUSet
		for i := range len(all) * 64 {
			all.Set(i)
		}
		if unix.SchedSetaffinity(0, &all) != nil {
			return err
		}
	}
	p.moved = false
	return nil
}
