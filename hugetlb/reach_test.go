package hugetlb_test

import (
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
)

func init() { testproc.Register("many-files", helperManyFiles) }

// helperManyFiles opens args[0] descriptors of /dev/null, parks args[1]
// goroutines each on a thread of its own, says "ready" and waits for its
// input to end. It maps no data memory.
func helperManyFiles(args []string) int {
	files, _ := strconv.Atoi(args[0])
	threads, _ := strconv.Atoi(args[1])
	var open []*os.File
	for range files {
		f, err := os.Open(os.DevNull)
		if err != nil {
			testproc.Say("open-failed %v", err)
			return 3
		}
		open = append(open, f)
	}
	park := make(chan struct{})
	for range threads {
		started := make(chan struct{})
		go func() {
			runtime.LockOSThread()
			close(started)
			<-park
		}()
		<-started
	}
	testproc.Say("ready")
	testproc.Commands().Scan() // until the test ends
	close(park)
	runtime.KeepAlive(open)
	return 0
}

// The threads of a process share one table of open files, as a rule: it
// is read once, not once a thread. Here 40 threads hold 1,000 files.
func TestReachesReadsASharedTableOfFilesOnce(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 4})
	const files, threads = 1000, 40
	h := testproc.Start(t, "many-files", []string{strconv.Itoa(files), strconv.Itoa(threads)})
	h.Expect("ready", 0)
	tasks, err := os.ReadDir("/proc/" + strconv.Itoa(h.PID()) + "/task")
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(tasks), threads)

	before := hugetlb.FDInfosRead()
	reach, known := in.mem.Reaches(h.PID())
	assert.True(t, known)
	assert.False(t, reach, "it maps and holds nothing of the memory")
	read := hugetlb.FDInfosRead() - before
	assert.GreaterOrEqual(t, read, int64(files), "every file is looked at")
	assert.Less(t, read, int64(2*files), "%d threads, one table: read once", len(tasks))
}

// A caller that cannot wait is told the answer did not come in time, not
// a wrong answer.
func TestReachesWithinGivesUpAtTheDeadline(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 4})
	_, err := in.mem.Alloc(in.mem.Lists()[0].PageSize)
	require.NoError(t, err)
	_, _, done := in.mem.ReachesWithin(os.Getpid(), -time.Nanosecond)
	assert.False(t, done, "no time at all")
	reach, known, done := in.mem.ReachesWithin(os.Getpid(), time.Minute)
	assert.True(t, done)
	assert.True(t, known)
	assert.True(t, reach, "this process maps the memory")
}
