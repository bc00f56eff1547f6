package testenv

import (
	"bytes"
	"os"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/sys/affinity"
)

// CPUs returns the CPUs the calling thread may use, in order.
func CPUs() ([]int, error) { return affinity.Usable() }

// NeedCPUs returns the CPUs the calling thread may use, skipping tb if
// there are fewer than n: a test of CPU bindings cannot tell a thread
// bound to the only CPU from one that may run anywhere.
func NeedCPUs(tb testing.TB, n int) []int {
	tb.Helper()
	cpus, err := CPUs()
	if err != nil {
		tb.Fatal(err)
	}
	if len(cpus) < n {
		tb.Skipf("needs a process that may use %d CPUs or more; this one may use %d", n, len(cpus))
	}
	return cpus
}

// ThreadsBoundTo counts this process's threads whose affinity is exactly
// cpu: all of them, and those other than the main thread (which the Go
// runtime parks for good, binding and all, when a goroutine locked to it
// exits).
func ThreadsBoundTo(tb testing.TB, cpu int) (all, others int) {
	tb.Helper()
	for _, tid := range ThreadIDsBoundTo(tb, cpu) {
		all++
		if tid != os.Getpid() {
			others++
		}
	}
	return all, others
}

// ThreadIDsBoundTo returns the ids of this process's threads whose
// affinity is exactly cpu.
func ThreadIDsBoundTo(tb testing.TB, cpu int) []int {
	tb.Helper()
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		tb.Fatal(err)
	}
	var tids []int
	for _, task := range tasks {
		tid, err := strconv.Atoi(task.Name())
		if err != nil {
			tb.Fatal(err)
		}
		var set unix.CPUSet
		if unix.SchedGetaffinity(tid, &set) == nil && set.Count() == 1 && set.IsSet(cpu) { // else ended meanwhile
			tids = append(tids, tid)
		}
	}
	return tids
}

// ThreadSyscall returns the number of the system call that thread tid of
// this process is in, and false when it is in none (running, or just
// leaving one): /proc/self/task/TID/syscall.
func ThreadSyscall(tb testing.TB, tid int) (int, bool) {
	tb.Helper()
	b, err := os.ReadFile("/proc/self/task/" + strconv.Itoa(tid) + "/syscall")
	if err != nil {
		tb.Fatal(err)
	}
	f := bytes.Fields(b)
	if len(f) == 0 {
		tb.Fatalf("thread %d: cannot parse %q", tid, b)
	}
	n, err := strconv.Atoi(string(f[0]))
	if err != nil || n < 0 {
		return 0, false // "running", or -1: in no system call
	}
	return n, true
}

// ThreadsInSyscall counts this process's threads blocked in system call
// nr (unix.SYS_*), as /proc/self/task/*/syscall says.
func ThreadsInSyscall(nr int) int {
	tasks, _ := os.ReadDir("/proc/self/task")
	prefix := []byte(strconv.Itoa(nr) + " ")
	n := 0
	for _, task := range tasks {
		b, err := os.ReadFile("/proc/self/task/" + task.Name() + "/syscall")
		if err == nil && bytes.HasPrefix(b, prefix) {
			n++
		}
	}
	return n
}
