package hugetlb_test

import (
	"bytes"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
)

// The name of a list's backing file, as the segment gives it, now leads
// to another file: a link, which any process of the primary's user may
// put there. Opened by path, Attach refuses it; handed the primary's open
// files, it maps them and never looks at the name.
func TestAttachMapsTheFilesItIsHanded(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 4})
	ps := in.b.PageSize
	r, err := in.mem.Alloc(ps)
	require.NoError(t, err)
	file := in.mem.Lists()[0].File
	kept := testenv.File(t, in.b.Dir) // the same file, for the helper to open
	require.NoError(t, os.Link(file, kept))
	decoy := testenv.File(t, in.b.Dir)
	require.NoError(t, os.WriteFile(decoy, make([]byte, 4*ps), 0o600))
	require.NoError(t, os.Remove(file))
	require.NoError(t, os.Symlink(decoy, file))
	t.Cleanup(func() { os.Remove(file) })

	p := testproc.Start(t, "secondary", []string{in.opts.Path})
	assert.Contains(t, p.Expect("attach-error", 0), "too many levels of symbolic links", "a link at the backing file's name")

	sec := startSecondary(t, in, "files", "rdwr", kept)
	ask(t, sec, "filled", "fill %#x %d 7", r.Addr, r.Len)
	assert.Equal(t, -1, verify(r.Bytes(), 7), "the primary sees what the secondary wrote")
	b, err := os.ReadFile(decoy)
	require.NoError(t, err)
	assert.Equal(t, len(b), bytes.Count(b, []byte{0}), "the file behind the link is untouched")
}

// Files handed to Attach must be one per list, each open for reading and
// writing; otherwise it fails before it maps anything.
func TestAttachChecksTheFilesItIsHanded(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 2}, hugetlb.ListConfig{Pages: 2})
	lists := in.mem.Lists()
	for _, c := range []struct {
		name string
		args []string
		want string
	}{
		{"one short", []string{"files", "rdwr", lists[0].File}, "2 lists, 1 backing files"},
		{"read only", []string{"files", "rdonly", lists[0].File, lists[1].File}, "not open for reading and writing"},
		{"not regular", []string{"files", "rdonly", in.b.Dir, lists[1].File}, "not a regular file"},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := testproc.Start(t, "secondary", append([]string{in.opts.Path}, c.args...))
			line := p.Expect("attach-error", 0)
			assert.Contains(t, line, c.want)
			assert.Contains(t, line, "bad memseg list descriptor")
		})
	}
}
