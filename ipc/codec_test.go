package ipc_test

import (
	"bytes"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/mpmr/mpmr/ipc"
)

func frame(t testing.TB, id uint64, kind ipc.Kind, files int, body any) []byte {
	t.Helper()
	b, err := ipc.AppendFrame(nil, id, kind, files, body)
	require.NoError(t, err)
	return b
}

func TestFrameRoundTrip(t *testing.T) {
	for _, id := range []uint64{0, 1, 127, 128, 255, 256, 65535, 65536, math.MaxUint32, math.MaxUint32 + 1, math.MaxUint64} {
		b := frame(t, id, ipc.KindCreateMR, 2, &ipc.CreateMR{Addr: 0xdead_b000})
		f, err := ipc.ParseFrame(b)
		require.NoError(t, err, "id %d", id)
		assert.Equal(t, id, f.ID)
		assert.Equal(t, ipc.KindCreateMR, f.Kind)
		assert.Equal(t, 2, f.Files)
		var m ipc.CreateMR
		require.NoError(t, ipc.Unmarshal(f.Body, &m))
		assert.Equal(t, uint64(0xdead_b000), m.Addr)
	}
}

func TestFrameIsCompact(t *testing.T) {
	b := frame(t, 1, ipc.KindCreateMR, 0, &ipc.CreateMR{Addr: 0x7f00_0000_1000})
	assert.LessOrEqual(t, len(b), 24, "a create-MR request is a few bytes: % x", b)
}

// raw builds msgpack bytes by hand, for frames no encoder would write.
func raw(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

func TestParseFrameRejects(t *testing.T) {
	body := func(v any) []byte { b, err := msgpack.Marshal(v); require.NoError(t, err); return b }
	good := frame(t, 1, ipc.KindCreateMR, 0, &ipc.CreateMR{Addr: 1})
	nested := []byte{}
	for range 20 {
		nested = append(nested, 0x91) // [[[[...
	}
	nested = append(nested, 0x01)
	cases := []struct {
		name string
		b    []byte
		want error
	}{
		{"empty", nil, ipc.ErrMalformed},
		{"not an array", body("hello"), ipc.ErrMalformed},
		{"three elements", raw([]byte{0x93, 1, 17}, body(nil)), ipc.ErrMalformed},
		{"five elements", raw([]byte{0x95, 1, 17, 0}, body(nil), body(nil)), ipc.ErrMalformed},
		{"negative id", raw([]byte{0x94, 0xff, 17, 0}, body(nil)), ipc.ErrMalformed},
		{"string id", raw([]byte{0x94, 0xa1, 'x', 17, 0}, body(nil)), ipc.ErrMalformed},
		{"kind beyond 16 bits", raw([]byte{0x94, 1, 0xce, 0, 1, 0, 0, 0}, body(nil)), ipc.ErrMalformed},
		{"too many files", raw([]byte{0x94, 1, 17, 0x7f}, body(nil)), ipc.ErrMalformed},
		{"no body", []byte{0x94, 1, 17, 0}, ipc.ErrMalformed},
		{"cut short", good[:len(good)-1], ipc.ErrMalformed},
		{"trailing bytes", append(bytes.Clone(good), 0xc0), ipc.ErrMalformed},
		{"never-used code", raw([]byte{0x94, 1, 17, 0, 0xc1}), ipc.ErrMalformed},
		{"extension type", raw([]byte{0x94, 1, 17, 0, 0xd4, 1, 1}), ipc.ErrMalformed},
		{"nested too deep", raw([]byte{0x94, 1, 17, 0}, nested), ipc.ErrMalformed},
		{"array longer than its bytes", raw([]byte{0x94, 1, 17, 0, 0xdd, 0, 0, 0x10, 0}), ipc.ErrMalformed},
		{"map longer than allowed", raw([]byte{0x94, 1, 17, 0, 0xde, 0x10, 0x01}, bytes.Repeat([]byte{1}, 2*0x1001)), ipc.ErrMalformed},
		{"string longer than its bytes", raw([]byte{0x94, 1, 17, 0, 0xdb, 0xff, 0xff, 0xff, 0xff, 'a'}), ipc.ErrMalformed},
		{"unknown kind", frame(t, 1, 999, 0, nil), ipc.ErrUnknownKind},
		{"too large", raw([]byte{0x94, 1, 17, 0, 0xc6, 0, 1, 0, 0}, make([]byte, 1<<16)), ipc.ErrTooLarge},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := ipc.ParseFrame(c.b)
			assert.ErrorIs(t, err, c.want)
		})
	}
}

func TestUnmarshalIsStrict(t *testing.T) {
	enc := func(v any) []byte { b, err := msgpack.Marshal(v); require.NoError(t, err); return b }
	cases := []struct {
		name string
		b    []byte
		into any
	}{
		{"unknown field", enc(map[string]any{"addr": 1, "extra": 2}), &ipc.CreateMR{}},
		{"wrong type", enc(map[string]any{"addr": "0x1000"}), &ipc.CreateMR{}},
		{"trailing bytes", append(enc(map[string]any{"addr": 1}), 0xc0), &ipc.CreateMR{}},
		{"array form with an extra element", enc([]any{1, 2, 3}), &ipc.CreateMR{}},
		{"unknown field in a chunk", enc(map[string]any{"name": "p", "chunks": []any{map[string]any{"addr": 1, "len": 2, "x": 3}}}), &ipc.RegisterMempool{}},
		{"no chunks", enc(map[string]any{"name": "p", "chunks": []any{}}), &ipc.RegisterMempool{}},
		{"empty chunk", enc(&ipc.RegisterMempool{Name: "p", Chunks: []ipc.Chunk{{Addr: 1, Len: 0}}}), &ipc.RegisterMempool{}},
		{"chunk wrapping around", enc(&ipc.RegisterMempool{Name: "p", Chunks: []ipc.Chunk{{Addr: math.MaxUint64, Len: 2}}}), &ipc.RegisterMempool{}},
		{"too many chunks", enc(&ipc.RegisterMempool{Name: "p", Chunks: make([]ipc.Chunk, ipc.MaxChunks+1)}), &ipc.RegisterMempool{}},
		{"sync of no pages", enc(&ipc.Sync{Op: ipc.SyncMap, Count: 0}), &ipc.Sync{}},
		{"sync of a negative page", enc(&ipc.Sync{Op: ipc.SyncUnmap, First: -1, Count: 1}), &ipc.Sync{}},
		{"unknown sync op", enc(&ipc.Sync{Op: 9, Count: 1}), &ipc.Sync{}},
		{"hello without pid", enc(&ipc.Hello{ABI: ipc.ABI, Role: "secondary"}), &ipc.Hello{}},
		{"hello without role", enc(&ipc.Hello{ABI: ipc.ABI, PID: 1}), &ipc.Hello{}},
		{"empty region", enc(&ipc.CreateMRReply{Start: 0x2000, End: 0x2000}), &ipc.CreateMRReply{}},
		{"odd page size", enc(&ipc.HelloReply{PageSize: 3000}), &ipc.HelloReply{}},
		{"negative hold", enc(&ipc.HelloReply{Hold: -1}), &ipc.HelloReply{}},
		{"hold past the bound", enc(&ipc.HelloReply{Hold: int64(ipc.MaxHold) + 1}), &ipc.HelloReply{}},
		{"field in an empty message", enc(map[string]any{"x": 1}), &ipc.Detach{}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			assert.ErrorIs(t, ipc.Unmarshal(c.b, c.into), ipc.ErrMalformed)
		})
	}
}

// Every message survives a round trip through Marshal and Unmarshal.
func TestMessagesRoundTrip(t *testing.T) {
	msgs := []any{
		&ipc.Hello{ABI: ipc.ABI, PID: 42, UID: 1000, Start: 123456, Role: "secondary"},
		&ipc.HelloReply{Slot: 3, Segment: "/dev/hugepages/mpmr-x", LockFile: "/dev/hugepages/mpmr-x.lock",
			LayoutTag: 0x5eed, Backend: "hugetlbfs", PageSize: 2 << 20, PrimaryPID: 7, Hold: int64(2050 * time.Millisecond)},
		&ipc.CreateMR{Addr: 0x7f12_3456_7000},
		&ipc.CreateMRReply{Start: 0x7f12_3440_0000, End: 0x7f12_3460_0000, LKey: 0xabcdef},
		&ipc.RegisterMempool{Name: "mbufs", Chunks: []ipc.Chunk{{Addr: 0x1000, Len: 0x2000}, {Addr: 0x9000, Len: 1}}},
		&ipc.RegisterMempoolReply{Keys: []uint32{1, 2, 3}},
		&ipc.Sync{Op: ipc.SyncMap, List: 1, First: 8, Count: 4},
		&ipc.Sync{Op: ipc.SyncResync},
		&ipc.SyncAck{},
		&ipc.StatsRequest{},
		&ipc.StatsReply{PID: 9, Secondaries: 2, MRs: 5, Counters: map[string]uint64{"creates": 4, "hits.top": 1 << 40}},
		&ipc.Detach{},
		&ipc.DetachReply{},
		&ipc.ErrorReply{Code: "x.y", Message: "went wrong"},
	}
	for _, m := range msgs {
		b, err := ipc.Marshal(m)
		require.NoError(t, err)
		got := newOf(m)
		require.NoError(t, ipc.Unmarshal(b, got), "%T", m)
		assert.Equal(t, m, got)
	}
}

func newOf(v any) any {
	switch v.(type) {
	case *ipc.Hello:
		return &ipc.Hello{}
	case *ipc.HelloReply:
		return &ipc.HelloReply{}
	case *ipc.CreateMR:
		return &ipc.CreateMR{}
	case *ipc.CreateMRReply:
		return &ipc.CreateMRReply{}
	case *ipc.RegisterMempool:
		return &ipc.RegisterMempool{}
	case *ipc.RegisterMempoolReply:
		return &ipc.RegisterMempoolReply{}
	case *ipc.Sync:
		return &ipc.Sync{}
	case *ipc.SyncAck:
		return &ipc.SyncAck{}
	case *ipc.StatsRequest:
		return &ipc.StatsRequest{}
	case *ipc.StatsReply:
		return &ipc.StatsReply{}
	case *ipc.Detach:
		return &ipc.Detach{}
	case *ipc.DetachReply:
		return &ipc.DetachReply{}
	case *ipc.ErrorReply:
		return &ipc.ErrorReply{}
	}
	panic("no such message")
}

func TestKinds(t *testing.T) {
	for _, k := range []ipc.Kind{ipc.KindHello, ipc.KindCreateMR, ipc.KindRegisterMempool, ipc.KindStats, ipc.KindDetach} {
		assert.True(t, k.IsRequest(), "%s", k)
		assert.False(t, k.IsPush(), "%s", k)
	}
	assert.True(t, ipc.KindSync.IsPush())
	assert.False(t, ipc.KindSync.IsRequest())
	for _, k := range []ipc.Kind{ipc.KindReply, ipc.KindError, ipc.KindChannel, ipc.KindCancel, 999} {
		assert.False(t, k.IsRequest() || k.IsPush(), "%s", k)
	}
	assert.Equal(t, "create-mr", ipc.KindCreateMR.String())
	assert.Equal(t, "kind(999)", ipc.Kind(999).String())
}
