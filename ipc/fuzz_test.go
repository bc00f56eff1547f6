package ipc_test

import (
	"bytes"
	"reflect"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/mpmr/mpmr/ipc"
)

// Every decoder of peer-written bytes has a fuzz target. Without -fuzz they
// run their seed corpus as ordinary tests.

func FuzzParseFrame(f *testing.F) {
	seeds := []struct {
		kind ipc.Kind
		body any
	}{
		{ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: 1, Role: "secondary"}},
		{ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1000}},
		{ipc.KindRegisterMempool, &ipc.RegisterMempool{Name: "p", Chunks: []ipc.Chunk{{Addr: 1, Len: 2}}}},
		{ipc.KindSync, &ipc.Sync{Op: ipc.SyncMap, Count: 1}},
		{ipc.KindStats, &ipc.StatsReply{Counters: map[string]uint64{"a": 1}}},
		{ipc.KindReply, nil},
		{ipc.KindError, &ipc.ErrorReply{Code: "c", Message: "m"}},
		{ipc.KindChannel, &ipc.Channel{}},
		{ipc.KindCancel, &ipc.Cancel{}},
		{999, []any{1, "x", 2.5, true, []byte{1}}},
	}
	for i, s := range seeds {
		b, err := ipc.AppendFrame(nil, uint64(i)<<40, s.kind, i%3, s.body)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0x94, 0xcf, 0, 0, 0, 0, 0, 0, 0, 1, 0x11, 0, 0xc0})
	f.Add([]byte{0x94, 1, 17, 0, 0x91, 0x91, 0x91, 0xc0})
	f.Add([]byte{0x94, 1, 17, 0, 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		fr, err := ipc.ParseFrame(b)
		if err != nil {
			return
		}
		if len(fr.Body) == 0 || len(fr.Body) > len(b) || fr.Files > ipc.MaxFiles {
			t.Fatalf("accepted frame with body of %d bytes of %d, %d files", len(fr.Body), len(b), fr.Files)
		}
		// An accepted frame is one msgpack value as far as the library
		// that decodes bodies is concerned, too.
		r := bytes.NewReader(b)
		if err := msgpack.NewDecoder(r).Skip(); err != nil || r.Len() != 0 {
			t.Fatalf("msgpack does not see one value in an accepted frame (%v, %d bytes left)", err, r.Len())
		}
		// Re-encoding the parts gives back a frame that parses the same.
		again, err := ipc.AppendFrame(nil, fr.ID, fr.Kind, fr.Files, msgpack.RawMessage(fr.Body))
		if err != nil {
			t.Fatal(err)
		}
		fr2, err := ipc.ParseFrame(again)
		if err != nil || fr2.ID != fr.ID || fr2.Kind != fr.Kind || fr2.Files != fr.Files || string(fr2.Body) != string(fr.Body) {
			t.Fatalf("re-encoded frame differs: %+v vs %+v (%v)", fr2, fr, err)
		}
	})
}

// fuzzMessage fuzzes Unmarshal into a new T: it must not panic, and what it
// accepts must be valid and survive a round trip unchanged.
func fuzzMessage[T any](f *testing.F, seeds ...*T) {
	for _, s := range seeds {
		b, err := ipc.Marshal(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0xc0})
	f.Add([]byte{0x80})
	f.Add([]byte{0x81, 0xa1, 'x', 0x01})
	f.Fuzz(func(t *testing.T, b []byte) {
		m := new(T)
		if err := ipc.Unmarshal(b, m); err != nil {
			return
		}
		if v, ok := any(m).(interface{ Validate() error }); ok {
			if err := v.Validate(); err != nil {
				t.Fatalf("accepted an invalid %T: %v", m, err)
			}
		}
		again, err := ipc.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		m2 := new(T)
		if err := ipc.Unmarshal(again, m2); err != nil {
			t.Fatalf("re-encoded %T rejected: %v", m, err)
		}
		if !reflect.DeepEqual(m, m2) {
			t.Fatalf("round trip changed %+v into %+v", m, m2)
		}
	})
}

func FuzzHello(f *testing.F) {
	fuzzMessage(f, &ipc.Hello{ABI: ipc.ABI, PID: 4242, UID: 1000, Start: 99, Role: "secondary"})
}

func FuzzHelloReply(f *testing.F) {
	fuzzMessage(f, &ipc.HelloReply{Slot: 2, Segment: "/dev/shm/s", LockFile: "/dev/shm/l", LayoutTag: 1,
		Backend: "tmpfs", PageSize: 4096, PrimaryPID: 1})
}

func FuzzCreateMR(f *testing.F) { fuzzMessage(f, &ipc.CreateMR{Addr: 0x7f00_0000_1000}) }

func FuzzCreateMRReply(f *testing.F) {
	fuzzMessage(f, &ipc.CreateMRReply{Start: 0x1000, End: 0x201000, LKey: 77})
}

func FuzzRegisterMempool(f *testing.F) {
	fuzzMessage(f, &ipc.RegisterMempool{Name: "mbufs", Chunks: []ipc.Chunk{{Addr: 0x1000, Len: 64}, {Addr: 1 << 40, Len: 1 << 21}}})
}

func FuzzRegisterMempoolReply(f *testing.F) {
	fuzzMessage(f, &ipc.RegisterMempoolReply{Keys: []uint32{1, 1 << 31}})
}

func FuzzSync(f *testing.F) {
	fuzzMessage(f, &ipc.Sync{Op: ipc.SyncUnmap, List: 1, First: 3, Count: 2}, &ipc.Sync{Op: ipc.SyncResync})
}

func FuzzStatsReply(f *testing.F) {
	fuzzMessage(f, &ipc.StatsReply{PID: 1, Secondaries: 2, MRs: 3, Counters: map[string]uint64{"x": 1}})
}

func FuzzErrorReply(f *testing.F) {
	fuzzMessage(f, &ipc.ErrorReply{Code: "ipc.malformed", Message: "bad"})
}

// The bodiless messages share one target: they accept nothing but nil, an
// empty map or an empty array.
func FuzzEmptyMessages(f *testing.F) {
	for _, b := range [][]byte{{0x80}, {0xc0}, {0x90}, {0x81, 0xa1, 'x', 0xc0}} {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, m := range []any{&ipc.SyncAck{}, &ipc.StatsRequest{}, &ipc.Detach{}, &ipc.DetachReply{}, &ipc.Channel{}} {
			if ipc.Unmarshal(b, m) != nil {
				continue
			}
			var v any
			if err := msgpack.Unmarshal(b, &v); err != nil || reflect.ValueOf(v).IsValid() && reflect.ValueOf(v).Len() != 0 {
				t.Fatalf("%T accepted % x", m, b)
			}
		}
	})
}
