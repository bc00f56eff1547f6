package ipc

import "math"

// The hot messages' own codec.
//
// A create-MR request and its reply are on every secondary's miss path, a
// sync push and its acknowledgement on every memory change. The reflective
// msgpack codec costs about a third of a microsecond per frame on each
// side, a tenth of a round trip between processes. These messages hold
// only non-negative integers, so they write themselves: exactly the bytes
// the reflective encoder writes (a map of the field names in declaration
// order, each integer in its shortest form), and they read that form back
// by hand.
//
// Reading by hand takes only that canonical form. Anything else — keys in
// another order, a key missing or added, an integer in a form or of a size
// the field cannot hold — goes to the reflective decoder, so what a peer
// can have accepted, and how the rest is refused, is what it was.

// flatBody is a message that encodes and decodes its canonical form
// itself.
type flatBody interface {
	// appendFlat appends the message's msgpack form to b, and reports
	// false (leaving b as it was) for a value it does not write itself.
	appendFlat(b []byte) ([]byte, bool)
	// parseFlat sets the message from b and reports true if b is
	// exactly its canonical form; otherwise it leaves the message as it
	// was and reports false.
	parseFlat(b []byte) bool
}

var (
	_ flatBody = (*CreateMR)(nil)
	_ flatBody = (*CreateMRReply)(nil)
	_ flatBody = (*Sync)(nil)
	_ flatBody = (*SyncAck)(nil)
)

// appendKey appends a field name, a fixstr: every name here is shorter
// than 32 bytes.
func appendKey(b []byte, name string) []byte {
	return append(append(b, 0xa0|byte(len(name))), name...)
}

// flatReader reads a canonical map of integers, one field after the other;
// the first mismatch makes ok false for good.
type flatReader struct {
	b  []byte
	ok bool
}

// readFlat starts reading b as a map of n fields.
func readFlat(b []byte, n int) flatReader {
	return flatReader{b: b[min(1, len(b)):], ok: len(b) > 0 && b[0] == 0x80|byte(n)}
}

// uint reads the field called name, an integer no larger than limit.
func (r *flatReader) uint(name string, limit uint64) uint64 {
	n := len(name)
	if !r.ok || len(r.b) <= n || r.b[0] != 0xa0|byte(n) || string(r.b[1:1+n]) != name {
		r.ok = false
		return 0
	}
	v, rest, err := readUint(r.b[1+n:])
	if err != nil || v > limit {
		r.ok = false
		return 0
	}
	r.b = rest
	return v
}

// done reports whether every field was read and nothing follows.
func (r *flatReader) done() bool { return r.ok && len(r.b) == 0 }

// A nil message goes to the reflective codec, which says what it makes of
// one.

func (m *CreateMR) appendFlat(b []byte) ([]byte, bool) {
	if m == nil {
		return b, false
	}
	if m.CPU == 0 { // omitted
		return appendUint(appendKey(append(b, 0x81), "addr"), m.Addr), true
	}
	b = appendUint(appendKey(append(b, 0x82), "addr"), m.Addr)
	return appendUint(appendKey(b, "cpu"), uint64(m.CPU)), true
}

func (m *CreateMR) parseFlat(b []byte) bool {
	if m == nil || len(b) == 0 {
		return false
	}
	r := readFlat(b, 1)
	if b[0] == 0x82 {
		r = readFlat(b, 2)
	}
	addr := r.uint("addr", math.MaxUint64)
	var cpu uint64
	if b[0] == 0x82 {
		// Written only when not 0: a 0 written out is not the canonical
		// form, and goes to the reflective decoder.
		if cpu = r.uint("cpu", math.MaxUint32); cpu == 0 {
			return false
		}
	}
	if r.done() {
		// As the reflective decoder: a field left out keeps its value.
		m.Addr = addr
		if b[0] == 0x82 {
			m.CPU = uint32(cpu)
		}
	}
	return r.done()
}

func (m *CreateMRReply) appendFlat(b []byte) ([]byte, bool) {
	if m == nil {
		return b, false
	}
	b = appendUint(appendKey(append(b, 0x83), "start"), m.Start)
	b = appendUint(appendKey(b, "end"), m.End)
	return appendUint(appendKey(b, "lkey"), uint64(m.LKey)), true
}

func (m *CreateMRReply) parseFlat(b []byte) bool {
	if m == nil {
		return false
	}
	r := readFlat(b, 3)
	start := r.uint("start", math.MaxUint64)
	end := r.uint("end", math.MaxUint64)
	key := r.uint("lkey", math.MaxUint32)
	if r.done() {
		*m = CreateMRReply{Start: start, End: end, LKey: uint32(key)}
	}
	return r.done()
}

func (m *Sync) appendFlat(b []byte) ([]byte, bool) {
	// No valid Sync holds a negative number, but Marshal still writes
	// what it is given: the reflective encoder writes those.
	if m == nil || m.List < 0 || m.First < 0 || m.Count < 0 {
		return b, false
	}
	b = appendUint(appendKey(append(b, 0x84), "op"), uint64(m.Op))
	b = appendUint(appendKey(b, "list"), uint64(m.List))
	b = appendUint(appendKey(b, "first"), uint64(m.First))
	return appendUint(appendKey(b, "count"), uint64(m.Count)), true
}

func (m *Sync) parseFlat(b []byte) bool {
	if m == nil {
		return false
	}
	r := readFlat(b, 4)
	op := r.uint("op", math.MaxUint8)
	list := r.uint("list", math.MaxInt)
	first := r.uint("first", math.MaxInt)
	count := r.uint("count", math.MaxInt)
	if r.done() {
		*m = Sync{Op: SyncOp(op), List: int(list), First: int(first), Count: int(count)}
	}
	return r.done()
}

func (m *SyncAck) appendFlat(b []byte) ([]byte, bool) {
	if m == nil {
		return b, false
	}
	return append(b, 0x80), true
}

func (m *SyncAck) parseFlat(b []byte) bool { return m != nil && len(b) == 1 && b[0] == 0x80 }
