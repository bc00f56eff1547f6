package main

import (
	"encoding/json"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/shm"
)

var snakeKey = regexp.MustCompile(`^[a-z0-9]+(_[a-z0-9]+)*$`)

// walkJSON calls key for every object key and leaf for every value, with
// its path.
func walkJSON(path string, v any, key func(path, k string), leaf func(path string, v any)) {
	switch v := v.(type) {
	case map[string]any:
		for k, x := range v {
			key(path, k)
			walkJSON(path+"."+k, x, key, leaf)
		}
	case []any:
		for _, x := range v {
			walkJSON(path+"[]", x, key, leaf)
		}
	default:
		leaf(path, v)
	}
}

// The JSON of dump, stats and ls, from a live instance: one naming scheme
// (snake_case keys), enums by name, no empty placeholders; and the
// documented fields decode.
func TestJSONOutputReadsRight(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	p, cfg := startPrimary(t, b, rundir)
	r, err := p.Alloc(2 * b.PageSize)
	require.NoError(t, err)
	_, err = p.CreatePool("rx", 2048, 64)
	require.NoError(t, err)
	h := startSecondary(t, cfg.Prefix, rundir)
	parseKey(t, h.ask("lookup %d", r.Addr+8))

	enums := map[string]bool{} // paths whose values must be names
	for _, path := range []string{".processes[].role", ".memory[].backend", ".device_mrs[].access",
		".instance.state", ".instance.backend", ".segment.state"} {
		enums[path] = true
	}
	for _, cmd := range []string{"dump", "stats", "ls"} {
		t.Run(cmd, func(t *testing.T) {
			args := []string{"-json", "-rundir", rundir, cmd}
			if cmd != "ls" {
				args = append(args, cfg.Prefix)
			}
			out, stderr, status := tool(t, args...)
			require.Zero(t, status, stderr)
			var v any
			require.NoError(t, json.Unmarshal([]byte(out), &v))
			seen := map[string]bool{}
			walkJSON("", v, func(path, k string) {
				assert.Regexp(t, snakeKey, k, "key %q at %s", k, path)
			}, func(path string, x any) {
				seen[path] = true
				assert.NotNil(t, x, "%s is null", path)
				if enums[path] {
					assert.IsType(t, "", x, "%s is a name", path)
				}
			})
			if cmd != "ls" {
				assert.True(t, seen[".processes[].role"], "processes are listed with their roles")
			}
		})
	}

	var d dumpOut
	toolJSON(t, &d, "-rundir", rundir, "dump", cfg.Prefix)
	roles := map[shm.Role]int{}
	for _, pr := range d.Processes {
		roles[pr.Role]++
	}
	assert.Equal(t, map[shm.Role]int{shm.RolePrimary: 1, shm.RoleSecondary: 1}, roles)
	require.Len(t, d.Memory, 1)
	assert.Equal(t, b.Kind, d.Memory[0].Backend)
	require.NotEmpty(t, d.Cache.MRs)
	require.NotEmpty(t, d.Device)
	assert.Equal(t, d.Cache.MRs[0].LKey, d.Device[0].LKey)
	var st statsOut
	toolJSON(t, &st, "-rundir", rundir, "stats", cfg.Prefix)
	require.NotNil(t, st.Primary)
	assert.Equal(t, 1, st.Primary.Secondaries)
	require.NotEmpty(t, st.Processes)
	assert.Equal(t, shm.RolePrimary, st.Processes[0].Role)
}
