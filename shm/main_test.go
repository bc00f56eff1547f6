package shm_test

import (
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

func TestMain(m *testing.M) { testproc.Main(m) }

const testTag = 0x5eed

// quiet drops the segment's diagnostics (dead holders discarded and the
// like), which the tests provoke on purpose.
var quiet = slog.New(slog.DiscardHandler)

func opts(path string) shm.Options {
	return shm.Options{Path: path, LayoutTag: testTag, Slots: 16, Role: shm.RoleSecondary, Logger: quiet}
}

// newSegment creates a ready segment on b, closed and removed at cleanup.
func newSegment(t testing.TB, b hugetlb.Backend, tweak ...func(*shm.Options)) (*shm.Segment, shm.Options) {
	t.Helper()
	o := opts(testenv.File(t, b.Dir))
	o.Role = shm.RolePrimary
	for _, f := range tweak {
		f(&o)
	}
	s, err := shm.Create(o)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	require.NoError(t, s.MarkReady())
	o.Role = shm.RoleSecondary
	return s, o
}

func attach(t testing.TB, o shm.Options) *shm.Segment {
	t.Helper()
	s, err := shm.Attach(o)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}
