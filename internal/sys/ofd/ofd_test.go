package ofd

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func openTwice(t *testing.T) (*os.File, *os.File) {
	t.Helper()
	name := filepath.Join(t.TempDir(), "lock")
	a, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE, 0o600)
	require.NoError(t, err)
	t.Cleanup(func() { a.Close() })
	b, err := os.OpenFile(name, os.O_RDWR, 0)
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	return a, b
}

func TestDescriptionsOfOneProcessConflict(t *testing.T) {
	a, b := openTwice(t)
	require.NoError(t, TryLock(a, 3, true))

	assert.ErrorIs(t, TryLock(b, 3, true), ErrLocked, "second description must not get the byte")
	held, err := Held(b, 3)
	require.NoError(t, err)
	assert.True(t, held)

	held, err = Held(b, 4)
	require.NoError(t, err)
	assert.False(t, held, "a neighbouring byte is free")
	assert.NoError(t, TryLock(b, 4, true))
}

func TestCloseDropsTheLock(t *testing.T) {
	a, b := openTwice(t)
	require.NoError(t, TryLock(a, 0, true))
	require.NoError(t, a.Close())

	held, err := Held(b, 0)
	require.NoError(t, err)
	assert.False(t, held)
	assert.NoError(t, TryLock(b, 0, true))
}

func TestSharedLocksCoexist(t *testing.T) {
	a, b := openTwice(t)
	require.NoError(t, TryLock(a, 7, false))
	require.NoError(t, TryLock(b, 7, false))
	c, err := os.OpenFile(a.Name(), os.O_RDWR, 0)
	require.NoError(t, err)
	defer c.Close()
	assert.ErrorIs(t, TryLock(c, 7, true), ErrLocked)
	require.NoError(t, Unlock(a, 7))
	require.NoError(t, Unlock(b, 7))
	assert.NoError(t, TryLock(c, 7, true))
}
