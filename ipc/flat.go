package ipc

import (
	"encoding/binary"
	"math"
)

// The hot messages' own codec.
//
// A create-MR request and its reply are on every secondary's miss path, a
// sync push and its acknowledgement on every memory change, a cancellation
// on every call given up. The reflective
// msgpack codec costs about a third of a microsecond per frame on each
// side, a tenth of a round trip between processes. A mempool registration
// and its reply are not hot, but large: thousands of chunks, each of which
// the reflective decoder reads field by field through its type cache, at
// most of the primary's cost of a registration. These messages hold only
// non-negative integers, arrays of them and a name, so they write
// themselves: exactly the bytes the reflective encoder writes (a map of
// the field names in declaration order, each integer in its shortest
// form), and they read that form back by hand.
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
	_ flatBody = (*RegisterMempool)(nil)
	_ flatBody = (*RegisterMempoolReply)(nil)
	_ flatBody = (*Cancel)(nil)
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
	r.key(name)
	return r.value(limit)
}

// key reads the name of the next field, which must be name.
func (r *flatReader) key(name string) {
	n := len(name)
	if !r.ok || len(r.b) <= n || r.b[0] != 0xa0|byte(n) || string(r.b[1:1+n]) != name {
		r.ok = false
		return
	}
	r.b = r.b[1+n:]
}

// value reads an integer no larger than limit.
func (r *flatReader) value(limit uint64) uint64 {
	if !r.ok {
		return 0
	}
	v, rest, err := readUint(r.b)
	if err != nil || v > limit {
		r.ok = false
		return 0
	}
	r.b = rest
	return v
}

// str reads a string of at most maxName bytes, in any of the forms the
// reflective decoder reads as that string.
func (r *flatReader) str() string {
	if !r.ok || len(r.b) == 0 {
		r.ok = false
		return ""
	}
	var n, head int
	switch c := r.b[0]; {
	case c&0xe0 == 0xa0:
		n, head = int(c&0x1f), 1
	case c == 0xd9 && len(r.b) >= 2:
		n, head = int(r.b[1]), 2
	default: // longer than any name may be, or no string
		r.ok = false
		return ""
	}
	if len(r.b) < head+n {
		r.ok = false
		return ""
	}
	s := string(r.b[head : head+n])
	r.b = r.b[head+n:]
	return s
}

// array reads the length of an array of 1 to MaxItems values, each at
// least size bytes long: no more than the bytes left could hold, so that
// what the caller allocates for them is bounded by the frame. (Empty ones
// and longer ones go to the reflective decoder, which says what it makes
// of them.)
func (r *flatReader) array(size int) int {
	if !r.ok || len(r.b) == 0 {
		r.ok = false
		return 0
	}
	var n, head int
	switch c := r.b[0]; {
	case c&0xf0 == 0x90:
		n, head = int(c&0x0f), 1
	case c == 0xdc && len(r.b) >= 3:
		n, head = int(binary.BigEndian.Uint16(r.b[1:])), 3
	case c == 0xdd && len(r.b) >= 5:
		n, head = int(min(binary.BigEndian.Uint32(r.b[1:]), MaxItems+1)), 5
	}
	if n == 0 || n > MaxItems || n > (len(r.b)-head)/size {
		r.ok = false
		return 0
	}
	r.b = r.b[head:]
	return n
}

// appendArray appends the header of an array of n values.
func appendArray(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xdc), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdd), uint32(n))
}

// done reports whether every field was read and nothing follows.
func (r *flatReader) done() bool { return r.ok && len(r.b) == 0 }

// A nil message goes to the reflective codec, which says what it makes of
// one.

// A cancellation is an empty map: a peer may send many, and the lane's
// thread reads each.
func (m *Cancel) appendFlat(b []byte) ([]byte, bool) {
	if m == nil {
		return b, false
	}
	return append(b, 0x80), true
}

func (m *Cancel) parseFlat(b []byte) bool {
	return m != nil && len(b) == 1 && b[0] == 0x80
}

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

// into returns src in dst if dst has room for it, as the reflective
// decoder reuses a slice it decodes into, and src itself otherwise.
func into[T any](dst, src []T) []T {
	if cap(dst) >= len(src) {
		return append(dst[:0], src...)
	}
	return src
}

// A registration's name is written only up to maxName bytes (no valid one
// is longer), and its chunks and keys only when there are some: the
// reflective codec writes the rest.

func (m *RegisterMempool) appendFlat(b []byte) ([]byte, bool) {
	if m == nil || len(m.Name) > maxName || len(m.Chunks) == 0 {
		return b, false
	}
	b = appendKey(append(b, 0x82), "name")
	if len(m.Name) < 32 {
		b = append(b, 0xa0|byte(len(m.Name)))
	} else {
		b = append(b, 0xd9, byte(len(m.Name)))
	}
	b = appendArray(appendKey(append(b, m.Name...), "chunks"), len(m.Chunks))
	for _, c := range m.Chunks {
		b = appendUint(appendKey(append(b, 0x82), "addr"), c.Addr)
		b = appendUint(appendKey(b, "len"), c.Len)
	}
	return b, true
}

// flatChunkSize is the fewest bytes a chunk takes: a map header, two
// names and two one-byte integers.
const flatChunkSize = 1 + 1 + len("addr") + 1 + 1 + len("len") + 1

func (m *RegisterMempool) parseFlat(b []byte) bool {
	if m == nil {
		return false
	}
	r := readFlat(b, 2)
	r.key("name")
	name := r.str()
	r.key("chunks")
	n := r.array(flatChunkSize)
	if !r.ok {
		return false
	}
	// Into a fresh slice: the message is left as it was unless all of b
	// is read.
	chunks := make([]Chunk, n)
	for i := range chunks {
		c := readFlat(r.b, 2)
		chunks[i] = Chunk{Addr: c.uint("addr", math.MaxUint64), Len: c.uint("len", math.MaxUint64)}
		if r.ok = c.ok; !r.ok {
			return false
		}
		r.b = c.b
	}
	if !r.done() {
		return false
	}
	m.Chunks, m.Name = into(m.Chunks, chunks), name
	return true
}

func (m *RegisterMempoolReply) appendFlat(b []byte) ([]byte, bool) {
	if m == nil || len(m.Keys) == 0 {
		return b, false
	}
	b = appendArray(appendKey(append(b, 0x81), "keys"), len(m.Keys))
	for _, k := range m.Keys {
		b = appendUint(b, uint64(k))
	}
	return b, true
}

func (m *RegisterMempoolReply) parseFlat(b []byte) bool {
	if m == nil {
		return false
	}
	r := readFlat(b, 1)
	r.key("keys")
	n := r.array(1)
	if !r.ok {
		return false
	}
	keys := make([]uint32, n)
	for i := range keys {
		keys[i] = uint32(r.value(math.MaxUint32))
	}
	if !r.done() {
		return false
	}
	m.Keys = into(m.Keys, keys)
	return true
}
