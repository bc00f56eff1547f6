package hugetlb

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// fakeSystem points discovery at files written by the test: a mounts
// table, a meminfo and a hugepages sysfs tree.
type fakeSystem struct {
	dir string
}

func newFakeSystem(t *testing.T, mounts string, pools map[string][3]int) *fakeSystem {
	t.Helper()
	f := &fakeSystem{dir: t.TempDir()}
	write := func(name, content string) {
		p := filepath.Join(f.dir, name)
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, []byte(content), 0o644))
	}
	write("mounts", mounts)
	write("meminfo", "MemTotal:       24683652 kB\nHugepagesize:       2048 kB\n")
	require.NoError(t, os.MkdirAll(filepath.Join(f.dir, "hugepages"), 0o755))
	for name, v := range pools { // total, free, reserved
		write("hugepages/"+name+"/nr_hugepages", itoa(v[0]))
		write("hugepages/"+name+"/free_hugepages", itoa(v[1]))
		write("hugepages/"+name+"/resv_hugepages", itoa(v[2]))
	}
	oldMounts, oldMeminfo, oldPages := procMounts, procMeminfo, sysPages
	procMounts, procMeminfo, sysPages = filepath.Join(f.dir, "mounts"), filepath.Join(f.dir, "meminfo"), filepath.Join(f.dir, "hugepages")
	t.Cleanup(func() { procMounts, procMeminfo, sysPages = oldMounts, oldMeminfo, oldPages })
	return f
}

func itoa(n int) string { return strconv.Itoa(n) }

func TestMountsParsesPageSizesAndEscapes(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	newFakeSystem(t, "sysfs /sys sysfs rw 0 0\n"+
		"none "+a+" hugetlbfs rw,relatime,pagesize=1G 0 0\n"+
		"none "+b+" hugetlbfs rw,relatime 0 0\n"+
		"tmpfs /dev/shm tmpfs rw 0 0\n"+
		`none /mnt/with\040space hugetlbfs rw,pagesize=2M 0 0`+"\n", nil)
	ms, err := Mounts()
	require.NoError(t, err)
	require.Len(t, ms, 3)
	assert.Equal(t, Mount{Dir: a, PageSize: 1 << 30, Writable: true}, ms[0])
	assert.Equal(t, Mount{Dir: b, PageSize: 2 << 20, Writable: true}, ms[1], "no pagesize option: the default size")
	assert.Equal(t, "/mnt/with space", ms[2].Dir)
	assert.False(t, ms[2].Writable, "a directory that does not exist is not writable")
}

func TestPoolsReadsSysfs(t *testing.T) {
	newFakeSystem(t, "", map[string][3]int{"hugepages-2048kB": {64, 60, 4}, "hugepages-1048576kB": {2, 2, 0}})
	p, err := PoolFor(2 << 20)
	require.NoError(t, err)
	assert.Equal(t, Pool{PageSize: 2 << 20, Total: 64, Free: 60, Reserved: 4}, p)
	assert.Equal(t, uint64(56), p.Available())
	p, err = PoolFor(1 << 30)
	require.NoError(t, err)
	assert.Equal(t, uint64(2), p.Available())
	_, err = PoolFor(16 << 10)
	assert.ErrorIs(t, err, ErrNoPages)
}

func TestChooseSaysWhatIsMissing(t *testing.T) {
	mnt := t.TempDir()
	hugeMount := "none " + mnt + " hugetlbfs rw,pagesize=2M 0 0\n"
	cases := []struct {
		name     string
		mounts   string
		pools    map[string][3]int
		want     Want
		kind     Kind
		err      error
		contains string
	}{
		{name: "no mount", pools: map[string][3]int{"hugepages-2048kB": {64, 64, 0}},
			want: Want{Kind: Hugetlbfs}, err: ErrNoMount, contains: "mount -t hugetlbfs"},
		{name: "no free pages", mounts: hugeMount, pools: map[string][3]int{"hugepages-2048kB": {0, 0, 0}},
			want: Want{Kind: Hugetlbfs}, err: ErrNoPages, contains: "1 2 MiB pages needed, 0 free of 0"},
		{name: "pages all reserved", mounts: hugeMount, pools: map[string][3]int{"hugepages-2048kB": {8, 8, 8}},
			want: Want{Kind: Hugetlbfs, Pages: 2}, err: ErrNoPages, contains: "0 free of 8"},
		{name: "no pool of that size", mounts: hugeMount, pools: map[string][3]int{"hugepages-2048kB": {8, 8, 0}},
			want: Want{Kind: Hugetlbfs, PageSize: 1 << 30}, err: ErrNoPages, contains: "no 1 GiB hugepage pool"},
		{name: "available", mounts: hugeMount, pools: map[string][3]int{"hugepages-2048kB": {8, 8, 0}},
			want: Want{Kind: Hugetlbfs, Pages: 8}, kind: Hugetlbfs, contains: "8 of 8 2 MiB hugepages free"},
		{name: "auto falls back", pools: map[string][3]int{"hugepages-2048kB": {0, 0, 0}},
			want: Want{Kind: Auto}, kind: Tmpfs, contains: "fallback"},
		{name: "tmpfs forced", mounts: hugeMount, pools: map[string][3]int{"hugepages-2048kB": {8, 8, 0}},
			want: Want{Kind: Tmpfs}, kind: Tmpfs, contains: "forced by configuration"},
		{name: "directory not on hugetlbfs", pools: map[string][3]int{"hugepages-2048kB": {8, 8, 0}},
			want: Want{Kind: Hugetlbfs, Dir: mnt}, err: ErrNoMount, contains: "not on hugetlbfs"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			newFakeSystem(t, c.mounts, c.pools)
			b, err := Choose(c.want)
			if c.err != nil {
				require.ErrorIs(t, err, c.err)
				assert.Contains(t, err.Error(), c.contains)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, c.kind, b.Kind)
			assert.Contains(t, b.Reason, c.contains)
			if c.kind == Hugetlbfs {
				assert.Equal(t, mnt, b.Dir)
			} else {
				assert.Equal(t, DefaultTmpfsDir, b.Dir)
			}
			assert.Equal(t, uint64(2<<20), b.PageSize, "tmpfs keeps the hugepage granularity")
		})
	}
}

func TestParseAndFormatSize(t *testing.T) {
	for in, want := range map[string]uint64{"4096": 4096, "2M": 2 << 20, "2MB": 2 << 20, "2MiB": 2 << 20,
		"1G": 1 << 30, "2048k": 2 << 20, " 1g ": 1 << 30} {
		got, err := ParseSize(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, bad := range []string{"", "M", "-1", "1.5G", "99999999999T"} {
		_, err := ParseSize(bad)
		assert.Error(t, err, bad)
	}
	assert.Equal(t, "2 MiB", FormatSize(2<<20))
	assert.Equal(t, "1 GiB", FormatSize(1<<30))
	assert.Equal(t, "1536 KiB", FormatSize(1536<<10))
	assert.Equal(t, "100 B", FormatSize(100))
}

func TestParseKind(t *testing.T) {
	for in, want := range map[string]Kind{"": Auto, "auto": Auto, "HugeTLBfs": Hugetlbfs, "hugetlb": Hugetlbfs,
		"tmpfs": Tmpfs, "shm": Tmpfs} {
		got, err := ParseKind(in)
		require.NoError(t, err)
		assert.Equal(t, want, got)
	}
	_, err := ParseKind("ramdisk")
	assert.Error(t, err)
}

// A tmpfs backend in a directory given by configuration that is not on
// tmpfs is refused, saying so: its files would be a disk's, and
// secondaries take a segment only on tmpfs or hugetlbfs.
func TestChooseRefusesATmpfsDirectoryOffTmpfs(t *testing.T) {
	dir := t.TempDir()
	var st unix.Statfs_t
	require.NoError(t, unix.Statfs(dir, &st))
	if st.Type == unix.TMPFS_MAGIC {
		t.Skipf("the temporary directory %s is on tmpfs here", dir)
	}
	_, err := Choose(Want{Kind: Tmpfs, Dir: dir})
	require.ErrorIs(t, err, ErrNoTmpfs)
	assert.Contains(t, err.Error(), "not on tmpfs")

	b, err := Choose(Want{Kind: Tmpfs, Dir: DefaultTmpfsDir})
	require.NoError(t, err)
	assert.Equal(t, DefaultTmpfsDir, b.Dir)
}
