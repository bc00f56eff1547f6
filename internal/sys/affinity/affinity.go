// Package affinity is the door to the kernel's CPU affinity of threads.
package affinity

import "golang.org/x/sys/unix"

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
