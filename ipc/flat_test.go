package ipc

import (
	"bytes"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The hand-written codec of the hot messages must be indistinguishable
// from the reflective one: the same bytes out, and for any bytes in the
// same value or the same refusal.

// flatEdges are integers at every boundary between msgpack's forms.
var flatEdges = []uint64{0, 1, 0x7f, 0x80, 0xff, 0x100, 0xffff, 0x1_0000, math.MaxUint32, math.MaxUint32 + 1,
	math.MaxInt64, math.MaxInt64 + 1, math.MaxUint64}

// flatSamples returns values of every hot message built from the edges.
func flatSamples() []any {
	out := []any{&SyncAck{}, &Cancel{}}
	for _, a := range flatEdges {
		out = append(out, &CreateMR{Addr: a}, &CreateMR{Addr: a, CPU: uint32(min(a, math.MaxUint32))})
		for _, b := range flatEdges {
			out = append(out, &CreateMRReply{Start: a, End: b, LKey: uint32(b)})
			n := int(min(b, math.MaxInt64))
			out = append(out, &Sync{Op: SyncOp(a), List: n, First: int(min(a, math.MaxInt64)), Count: n})
		}
	}
	out = append(out, &Sync{Op: SyncMap, List: -1, First: -300, Count: math.MinInt64})
	for _, name := range []int{0, 31, 32, 255, 256} {
		for _, n := range []int{0, 1, 15, 16, MaxItems, MaxItems + 1, math.MaxUint16 + 1} {
			chunks := make([]Chunk, n)
			keys := make([]uint32, n)
			for i := range chunks {
				e := flatEdges[i%len(flatEdges)]
				chunks[i], keys[i] = Chunk{Addr: e, Len: flatEdges[(i+3)%len(flatEdges)]}, uint32(e)
			}
			out = append(out, &RegisterMempool{Name: strings.Repeat("p", name), Chunks: chunks}, &RegisterMempoolReply{Keys: keys})
		}
	}
	return append(out, &RegisterMempool{Name: "nil"}, &RegisterMempoolReply{})
}

func TestFlatEncodesAsReflective(t *testing.T) {
	for _, v := range flatSamples() {
		want, err := appendReflect([]byte{0xaa}, v)
		require.NoError(t, err)
		got, err := appendBody([]byte{0xaa}, v)
		require.NoError(t, err)
		require.Equal(t, want, got, "%T %+v", v, v)
	}
	var nilMR *CreateMR
	want, err := appendReflect(nil, nilMR)
	require.NoError(t, err)
	got, err := appendBody(nil, nilMR)
	require.NoError(t, err)
	assert.Equal(t, want, got, "nil message")
}

// newFlat returns one of each hot message, holding values the inputs
// below never carry, so that a field a decoder leaves alone shows.
func newFlat() []any {
	return []any{&CreateMR{Addr: 0xdead, CPU: 0xbeef}, &CreateMRReply{Start: 1, End: 2, LKey: 3}, &Sync{Op: 9, List: 9, First: 9, Count: 9}, &SyncAck{},
		&RegisterMempool{Name: "old", Chunks: []Chunk{{Addr: 9, Len: 9}, {Addr: 8, Len: 8}}}, &RegisterMempoolReply{Keys: make([]uint32, 2, 40)}, &Cancel{}}
}

// sameAsReflective decodes b into each hot message both ways and fails t
// on any difference in result or error.
func sameAsReflective(t *testing.T, b []byte) {
	t.Helper()
	a, r := newFlat(), newFlat()
	for i := range a {
		errA, errR := Unmarshal(b, a[i]), unmarshalReflect(b, r[i])
		if (errA == nil) != (errR == nil) || errA != nil && errA.Error() != errR.Error() {
			t.Fatalf("% x into %T: %v, reflective %v", b, a[i], errA, errR)
		}
		if !reflect.DeepEqual(a[i], r[i]) {
			t.Fatalf("% x into %T: %+v, reflective %+v", b, a[i], a[i], r[i])
		}
	}
}

// flatInputs are canonical bodies and near misses: keys reordered, missing
// or added, integers too large or negative or of another type, bytes cut
// short or left over.
func flatInputs(t testing.TB) [][]byte {
	var out [][]byte
	for _, v := range flatSamples() {
		b, err := appendReflect(nil, v)
		require.NoError(t, err)
		out = append(out, b, b[:len(b)-1], append(bytes.Clone(b), 0))
	}
	raw := func(m map[string]any) []byte {
		b, err := appendReflect(nil, m)
		require.NoError(t, err)
		return b
	}
	return append(out,
		nil, []byte{0xc0}, []byte{0x80}, []byte{0x81},
		raw(map[string]any{"addr": -1}),
		raw(map[string]any{"addr": int8(5)}),
		raw(map[string]any{"addr": 1.5}),
		raw(map[string]any{"addr": "x"}),
		raw(map[string]any{"address": 1}),
		raw(map[string]any{"lkey": uint64(1) << 33, "start": 1, "end": 2}),
		raw(map[string]any{"start": 1, "end": 2}),
		raw(map[string]any{"op": 300, "list": 0, "first": 0, "count": 1}),
		raw(map[string]any{"op": 1, "list": uint64(math.MaxUint64), "first": 0, "count": 1}),
		[]byte{0x81, 0xa4, 'a', 'd', 'd', 'r', 0xd0, 0x05}, // int8 5
		[]byte{0x81, 0xa4, 'a', 'd', 'd', 'r', 0xcc, 0x05}, // uint8 5, not the shortest
		[]byte{0x81, 0xd9, 4, 'a', 'd', 'd', 'r', 0x05},    // key as str8
		[]byte{0x83, 0xa3, 'e', 'n', 'd', 2, 0xa5, 's', 't', 'a', 'r', 't', 1, 0xa4, 'l', 'k', 'e', 'y', 3},
		[]byte{0x82, 0xa4, 'a', 'd', 'd', 'r', 1, 0xa4, 'a', 'd', 'd', 'r', 2}, // a key twice
		raw(map[string]any{"chunks": []Chunk{{1, 2}}, "name": "x"}),
		raw(map[string]any{"name": "x", "chunks": []any{map[string]any{"len": 2, "addr": 1}}}),
		raw(map[string]any{"name": "x", "chunks": []any{map[string]any{"addr": 1}}}),
		raw(map[string]any{"name": "x", "chunks": []any{map[string]any{"addr": -1, "len": 2}}}),
		raw(map[string]any{"name": "x", "chunks": []any{[]uint64{1, 2}}}),
		raw(map[string]any{"name": []byte("x"), "chunks": []Chunk{{1, 2}}}),
		raw(map[string]any{"name": nil, "chunks": []Chunk{{1, 2}}}),
		raw(map[string]any{"name": "x", "chunks": nil}),
		raw(map[string]any{"keys": []int64{1, -1}}),
		raw(map[string]any{"keys": []uint64{1, math.MaxUint32 + 1}}),
		raw(map[string]any{"keys": []any{1, "x"}}),
		raw(map[string]any{"keys": nil}),
		[]byte{0x82, 0xa4, 'n', 'a', 'm', 'e', 0xd9, 1, 'x', 0xa6, 'c', 'h', 'u', 'n', 'k', 's', 0xdc, 0, 1,
			0x82, 0xa4, 'a', 'd', 'd', 'r', 1, 0xa3, 'l', 'e', 'n', 2}, // a short name as str8, one chunk as array16
		[]byte{0x82, 0xa4, 'n', 'a', 'm', 'e', 0xda, 0, 1, 'x', 0xa6, 'c', 'h', 'u', 'n', 'k', 's', 0x91,
			0x82, 0xa4, 'a', 'd', 'd', 'r', 1, 0xa3, 'l', 'e', 'n', 2}, // a name as str16
		[]byte{0x81, 0xa4, 'k', 'e', 'y', 's', 0xdd, 0xff, 0xff, 0xff, 0xff, 1}, // an array that cannot be there
		[]byte{0x81, 0xa4, 'k', 'e', 'y', 's', 0xdd, 0, 0, 0, 2, 1, 2},          // two keys as array32
	)
}

func TestFlatDecodesAsReflective(t *testing.T) {
	for i, b := range flatInputs(t) {
		t.Run(fmt.Sprint(i), func(t *testing.T) { sameAsReflective(t, b) })
	}
}

func TestFlatNilMessage(t *testing.T) {
	b := []byte{0x81, 0xa4, 'a', 'd', 'd', 'r', 1}
	var m *CreateMR
	errA, errR := Unmarshal(b, m), unmarshalReflect(b, m)
	require.Error(t, errR)
	assert.EqualError(t, errA, errR.Error())
}

func FuzzFlatMatchesReflective(f *testing.F) {
	for _, b := range flatInputs(f) {
		f.Add(b)
	}
	f.Fuzz(sameAsReflective)
}

// The hot messages take the hand-written path: no allocation at all.
func TestFlatAllocatesNothing(t *testing.T) {
	buf := make([]byte, 0, 64)
	reply := &CreateMRReply{Start: 0x7f00_0000_0000, End: 0x7f00_0020_0000, LKey: 0x1234}
	var got CreateMRReply
	allocs := testing.AllocsPerRun(100, func() {
		b, err := appendBody(buf[:0], reply)
		if err != nil {
			t.Fatal(err)
		}
		if err := Unmarshal(b, &got); err != nil {
			t.Fatal(err)
		}
	})
	assert.Zero(t, allocs)
	assert.Equal(t, *reply, got)
}

// BenchmarkRegisterMempoolDecode decodes a registration of 2,000 chunks by
// hand and through the reflective decoder.
func BenchmarkRegisterMempoolDecode(b *testing.B) {
	m := &RegisterMempool{Name: "pkts", Chunks: make([]Chunk, 2000)}
	for i := range m.Chunks {
		m.Chunks[i] = Chunk{Addr: 0x7f00_0000_0000 + uint64(i)*4096, Len: 2048}
	}
	benchDecode(b, m, func() any { return &RegisterMempool{} })
}

// BenchmarkCancelDecode decodes a cancellation, which a peer may send by
// the thousand, by hand and through the reflective decoder.
func BenchmarkCancelDecode(b *testing.B) {
	benchDecode(b, &Cancel{}, func() any { return &Cancel{} })
}

// benchDecode decodes m's body into what fresh returns, by hand and
// through the reflective decoder.
func benchDecode(b *testing.B, m any, fresh func() any) {
	body, err := appendBody(nil, m)
	require.NoError(b, err)
	for _, way := range []struct {
		name   string
		decode func([]byte, any) error
	}{{"flat", Unmarshal}, {"reflective", unmarshalReflect}} {
		b.Run(way.name, func(b *testing.B) {
			for b.Loop() {
				if err := way.decode(body, fresh()); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
