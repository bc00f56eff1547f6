package ipc

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"sync"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/mpmr/mpmr/internal/sys/sock"
)

// MaxMessage is the largest frame, envelope included, that either side
// sends or accepts. A longer one is refused with ErrTooLarge and, when
// received, costs the sender its connection.
const MaxMessage = 64 << 10

// MaxFiles is the most open files one message may carry.
const MaxFiles = sock.MaxFiles

// MaxItems is the longest array or map any message may hold: it bounds
// what a peer can make the receiver allocate with a few header bytes.
const MaxItems = 4096

// maxDepth bounds the nesting of peer-written values (the deepest message,
// a mempool's chunk list inside its envelope, needs 4).
const maxDepth = 8

// Frame is one message as it travels: a msgpack array of four elements
// [id, kind, files, body], where files is how many descriptors came with
// the datagram and body is one msgpack value. A frame is exactly one
// SOCK_SEQPACKET datagram, so no length prefix is needed.
//
// The array form is fixed: a frame with another number of elements, with
// bytes after the body, or whose body is not a single well-formed value is
// malformed. A plain value; Body aliases the bytes it was parsed from.
type Frame struct {
	ID    uint64 // request id; a reply carries the id of what it answers
	Kind  Kind
	Files int    // descriptors that travel with the frame (SCM_RIGHTS)
	Body  []byte // one msgpack value; aliases the parsed buffer
}

// ParseFrame checks b as a frame and returns its parts without decoding
// the body (Unmarshal does that, strictly). Errors wrap ErrTooLarge,
// ErrMalformed or ErrUnknownKind. The returned Body aliases b.
func ParseFrame(b []byte) (Frame, error) {
	if len(b) > MaxMessage {
		return Frame{}, fmt.Errorf("%w: frame of %d bytes", ErrTooLarge, len(b))
	}
	if len(b) == 0 || b[0] != 0x94 { // fixarray of 4
		return Frame{}, fmt.Errorf("%w: envelope is not a 4-element array", ErrMalformed)
	}
	rest := b[1:]
	id, rest, err := readUint(rest)
	if err != nil {
		return Frame{}, fmt.Errorf("%w: envelope id: %w", ErrMalformed, err)
	}
	kind, rest, err := readUint(rest)
	if err != nil || kind > math.MaxUint16 {
		return Frame{}, fmt.Errorf("%w: envelope kind: %v", ErrMalformed, orRange(err))
	}
	files, rest, err := readUint(rest)
	if err != nil || files > MaxFiles {
		return Frame{}, fmt.Errorf("%w: envelope file count: %v", ErrMalformed, orRange(err))
	}
	f := Frame{ID: id, Kind: Kind(kind), Files: int(files), Body: rest}
	after, err := skipValue(rest, 0)
	if err != nil {
		return Frame{}, fmt.Errorf("%w: %s body: %w", ErrMalformed, f.Kind, err)
	}
	if len(after) != 0 {
		return Frame{}, fmt.Errorf("%w: %d bytes after the %s body", ErrMalformed, len(after), f.Kind)
	}
	if !f.Kind.known() {
		return Frame{}, fmt.Errorf("%w: %d", ErrUnknownKind, uint16(f.Kind))
	}
	return f, nil
}

func orRange(err error) error {
	if err == nil {
		return errOutOfRange
	}
	return err
}

// AppendFrame appends the frame [id, kind, files, body] to dst, with body
// encoded as msgpack. It does not check that kind is known: a test or a
// tool may want to send anything. The result may exceed MaxMessage; the
// sender checks.
func AppendFrame(dst []byte, id uint64, kind Kind, files int, body any) ([]byte, error) {
	dst = append(dst, 0x94)
	dst = appendUint(dst, id)
	dst = appendUint(dst, uint64(kind))
	dst = appendUint(dst, uint64(files))
	return appendBody(dst, body)
}

// Marshal encodes a message body as the peer will see it.
func Marshal(v any) ([]byte, error) { return appendBody(nil, v) }

// Unmarshal decodes one message body into v strictly: b must be a single
// well-formed msgpack value with nothing after it, no array or map may
// hold more than MaxItems entries, a struct may not receive a field it
// does not have, and a value that has a Validate() error method must pass
// it. Every failure wraps ErrMalformed.
func Unmarshal(b []byte, v any) error {
	if f, ok := v.(flatBody); ok && f.parseFlat(b) {
		return validate(v)
	}
	return unmarshalReflect(b, v)
}

// unmarshalReflect is Unmarshal through the reflective decoder.
func unmarshalReflect(b []byte, v any) error {
	after, err := skipValue(b, 0)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	if len(after) != 0 {
		return fmt.Errorf("%w: %d bytes after the value", ErrMalformed, len(after))
	}
	d := decoders.Get().(*decoder)
	d.r.Reset(b)
	d.dec.Reset(&d.r)
	d.dec.DisallowUnknownFields(true)
	err = d.dec.Decode(v)
	d.r.Reset(nil)
	decoders.Put(d)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	return validate(v)
}

// validate runs v's Validate method, if it has one.
func validate(v any) error {
	if val, ok := v.(interface{ Validate() error }); ok {
		if err := val.Validate(); err != nil {
			return fmt.Errorf("%w: %w", ErrMalformed, err)
		}
	}
	return nil
}

type decoder struct {
	dec *msgpack.Decoder
	r   bytes.Reader // a ByteScanner: the decoder reads it without buffering
}

var decoders = sync.Pool{New: func() any { return &decoder{dec: msgpack.NewDecoder(nil)} }}

type encoder struct {
	enc *msgpack.Encoder
	w   appendWriter
}

var encoders = sync.Pool{New: func() any { return &encoder{enc: msgpack.NewEncoder(nil)} }}

// appendWriter lets the msgpack encoder append to a caller's slice.
type appendWriter struct{ b []byte }

func (w *appendWriter) Write(p []byte) (int, error) { w.b = append(w.b, p...); return len(p), nil }
func (w *appendWriter) WriteByte(c byte) error      { w.b = append(w.b, c); return nil }

func appendBody(dst []byte, v any) ([]byte, error) {
	if f, ok := v.(flatBody); ok {
		if b, ok := f.appendFlat(dst); ok {
			return b, nil
		}
	}
	return appendReflect(dst, v)
}

// appendReflect is appendBody through the reflective encoder.
func appendReflect(dst []byte, v any) ([]byte, error) {
	e := encoders.Get().(*encoder)
	e.w.b = dst
	e.enc.Reset(&e.w)
	e.enc.UseCompactInts(true)
	err := e.enc.Encode(v)
	dst, e.w.b = e.w.b, nil
	encoders.Put(e)
	if err != nil {
		return dst, fmt.Errorf("ipc: encode %T: %w", v, err)
	}
	return dst, nil
}

func appendUint(dst []byte, n uint64) []byte {
	switch {
	case n <= 0x7f:
		return append(dst, byte(n))
	case n <= math.MaxUint8:
		return append(dst, 0xcc, byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xcd), uint16(n))
	case n <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(dst, 0xce), uint32(n))
	}
	return binary.BigEndian.AppendUint64(append(dst, 0xcf), n)
}

var (
	errShort      = errors.New("value cut short")
	errOutOfRange = errors.New("number out of range")
	errNotUint    = errors.New("not an unsigned integer")
	errTooDeep    = errors.New("values nested too deeply")
	errTooMany    = errors.New("array or map too long")
	errBadCode    = errors.New("invalid or unsupported msgpack type")
)

// readUint reads one non-negative integer in any msgpack integer form.
func readUint(b []byte) (uint64, []byte, error) {
	if len(b) == 0 {
		return 0, nil, errShort
	}
	c := b[0]
	if c <= 0x7f {
		return uint64(c), b[1:], nil
	}
	var n int
	signed := false
	switch c {
	case 0xcc, 0xcd, 0xce, 0xcf:
		n = 1 << (c - 0xcc)
	case 0xd0, 0xd1, 0xd2, 0xd3:
		n, signed = 1<<(c-0xd0), true
	default:
		return 0, nil, errNotUint
	}
	if len(b) < 1+n {
		return 0, nil, errShort
	}
	var v uint64
	for _, x := range b[1 : 1+n] {
		v = v<<8 | uint64(x)
	}
	if signed && b[1]&0x80 != 0 {
		return 0, nil, errNotUint // negative
	}
	return v, b[1+n:], nil
}

// skipValue checks that b starts with one well-formed msgpack value and
// returns what follows it. It allocates nothing and rejects what no
// message uses (extension types, the never-used code 0xc1), containers
// longer than MaxItems or than the bytes left could hold, and nesting
// deeper than maxDepth. This bounds what the reflective decoder behind
// Unmarshal can be made to allocate.
func skipValue(b []byte, depth int) ([]byte, error) {
	if depth > maxDepth {
		return nil, errTooDeep
	}
	if len(b) == 0 {
		return nil, errShort
	}
	c := b[0]
	b = b[1:]
	var items, size int // container entries; payload bytes
	pair := false       // a map's entries are key-value pairs
	switch {
	case c <= 0x7f || c >= 0xe0: // fixint
		return b, nil
	case c <= 0x8f: // fixmap
		items, pair = int(c&0x0f), true
	case c <= 0x9f: // fixarray
		items = int(c & 0x0f)
	case c <= 0xbf: // fixstr
		size = int(c & 0x1f)
	default:
		var err error
		switch c {
		case 0xc0, 0xc2, 0xc3: // nil, false, true
			return b, nil
		case 0xcc, 0xd0:
			size = 1
		case 0xcd, 0xd1:
			size = 2
		case 0xca, 0xce, 0xd2:
			size = 4
		case 0xcb, 0xcf, 0xd3:
			size = 8
		case 0xc4, 0xd9: // bin8, str8
			size, b, err = readLen(b, 1)
		case 0xc5, 0xda: // bin16, str16
			size, b, err = readLen(b, 2)
		case 0xc6, 0xdb: // bin32, str32
			size, b, err = readLen(b, 4)
		case 0xdc: // array16
			items, b, err = readLen(b, 2)
		case 0xdd: // array32
			items, b, err = readLen(b, 4)
		case 0xde: // map16
			items, b, err = readLen(b, 2)
			pair = true
		case 0xdf: // map32
			items, b, err = readLen(b, 4)
			pair = true
		default:
			return nil, errBadCode
		}
		if err != nil {
			return nil, err
		}
	}
	if size > 0 {
		if size > len(b) {
			return nil, errShort
		}
		return b[size:], nil
	}
	if items > MaxItems {
		return nil, errTooMany
	}
	if pair {
		items *= 2
	}
	if items > len(b) { // every entry takes at least one byte
		return nil, errShort
	}
	for range items {
		var err error
		if b, err = skipValue(b, depth+1); err != nil {
			return nil, err
		}
	}
	return b, nil
}

// readLen reads a big-endian length of w bytes.
func readLen(b []byte, w int) (int, []byte, error) {
	if len(b) < w {
		return 0, nil, errShort
	}
	var n uint64
	for _, x := range b[:w] {
		n = n<<8 | uint64(x)
	}
	if n > MaxMessage { // no length in a frame can exceed the frame
		return 0, nil, errShort
	}
	return int(n), b[w:], nil
}
