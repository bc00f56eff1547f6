package ipc

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"
)

// Errors of the channel itself. Errors that a handler returns travel to the
// caller as a code and a message; see RegisterError.
var (
	// ErrPeerGone means the connection ended before an answer came: the
	// peer closed it, died, or was dropped for breaking the protocol.
	// Every pending and later Call or Push on it fails with an error that
	// matches it, at once.
	ErrPeerGone = errors.New("ipc: peer has gone")
	// ErrClosed means this side closed the connection, client or server.
	ErrClosed = errors.New("ipc: closed")
	// ErrMalformed means bytes from a peer are not a valid frame or
	// message: broken msgpack, trailing bytes, an unknown field, a field
	// out of range. A server drops the connection that sent them.
	ErrMalformed = errors.New("ipc: malformed message")
	// ErrTooLarge means a frame exceeds MaxMessage.
	ErrTooLarge = errors.New("ipc: message too large")
	// ErrUnknownKind means a frame names a kind this side does not know,
	// or one that does not travel in that direction.
	ErrUnknownKind = errors.New("ipc: unknown message kind")
	// ErrRefused means the server refused the connection: the client's
	// uid is neither the server's, root, nor in its allowed list. The
	// connection error then matches both ErrRefused and ErrPeerGone.
	ErrRefused = errors.New("ipc: connection refused by credentials")
	// ErrNotListening means nobody listens at the socket path: no file, or
	// a file left by a server that ended.
	ErrNotListening = errors.New("ipc: no server listening")
	// ErrBusy means the server's queue of connections to accept stayed
	// full until the dial gave up: it listens, but does not keep up (it is
	// overloaded, or flooded with connections).
	ErrBusy = errors.New("ipc: server too busy to accept")
	// ErrAddressInUse means a live server already listens at the path.
	ErrAddressInUse = errors.New("ipc: socket address in use")
	// ErrBadPrefix means an instance prefix has characters or a length
	// that cannot make a safe directory name.
	ErrBadPrefix = errors.New("ipc: bad instance prefix")
	// ErrPermission means a permission problem on the way to an
	// instance: a refusal for safety — a directory or file (see RunDir),
	// or the process at the other end of a socket, belongs to a user this
	// process does not trust, or is writable by other users, so that
	// another user could have made or could change it — or, in the
	// runtimes, an instance this user may not reach. The message names
	// the path or peer, its owner and mode, this process's uid and the
	// fix.
	ErrPermission = errors.New("mpmr: permission problem")
	// ErrUnsafeDir is ErrPermission, by the name it had when it only
	// concerned the socket's directory.
	ErrUnsafeDir = ErrPermission
	// ErrNoHandler means the client has no PushHandler for a push.
	ErrNoHandler = errors.New("ipc: no handler for this message")
	// ErrFilesRefused means a message with descriptors was not sent: the
	// peer's socket takes none (a server made with ListenNoFiles, on a
	// kernel that can refuse them). The connection goes on.
	ErrFilesRefused = errors.New("ipc: the peer takes no descriptors")
)

// ErrorReply is the body of a KindError frame: a failed request or push.
// Code selects a registered sentinel error on the receiving side; Message is
// the full text of the error where it happened (cut to 1 KiB). A plain
// value.
type ErrorReply struct {
	Code    string `msgpack:"code"`
	Message string `msgpack:"msg"`
}

// Validate bounds the reply's strings.
func (r *ErrorReply) Validate() error {
	if len(r.Code) > maxCode {
		return fmt.Errorf("error code of %d bytes", len(r.Code))
	}
	return nil
}

const (
	maxCode    = 128
	maxMessage = 1024 // longest error text sent; longer ones are cut
)

// RemoteError is an error that a peer's handler returned. Error gives the
// peer's message. If its code is registered (RegisterError), it unwraps to
// that sentinel, so errors.Is(err, pkg.ErrX) works across processes.
// Immutable, so safe for concurrent use.
type RemoteError struct {
	Code    string
	Message string
	err     error // the registered sentinel, or nil
}

func (e *RemoteError) Error() string {
	if e.Message == "" {
		return "ipc: remote error " + e.Code
	}
	return e.Message
}

// Unwrap returns the sentinel registered for Code, or nil.
func (e *RemoteError) Unwrap() error { return e.err }

type registration struct {
	code string
	err  error
}

var registry = struct {
	sync.RWMutex
	byCode map[string]error
	byErr  map[error]string // comparable sentinels only
	list   []registration   // in registration order
}{byCode: map[string]error{}, byErr: map[error]string{}}

// RegisterError makes err travel as code: a handler that returns an error
// matching err (errors.Is) sends code, and the caller gets a *RemoteError
// that matches err again. Packages register their sentinels in init.
// Registering the same pair twice is harmless; a code bound to another
// error panics. Safe for concurrent use.
func RegisterError(code string, err error) {
	if code == "" || len(code) > maxCode || err == nil {
		panic(fmt.Sprintf("ipc: RegisterError(%q, %v): bad code or nil error", code, err))
	}
	registry.Lock()
	defer registry.Unlock()
	if prev, ok := registry.byCode[code]; ok {
		if prev != err {
			panic(fmt.Sprintf("ipc: error code %q registered twice", code))
		}
		return
	}
	registry.byCode[code] = err
	if _, ok := registry.byErr[err]; !ok && reflect.TypeOf(err).Comparable() {
		registry.byErr[err] = code
	}
	registry.list = append(registry.list, registration{code, err})
}

func init() {
	RegisterError("ipc.peer-gone", ErrPeerGone)
	RegisterError("ipc.closed", ErrClosed)
	RegisterError("ipc.malformed", ErrMalformed)
	RegisterError("ipc.too-large", ErrTooLarge)
	RegisterError("ipc.unknown-kind", ErrUnknownKind)
	RegisterError("ipc.refused", ErrRefused)
	RegisterError("ipc.no-handler", ErrNoHandler)
	RegisterError("context.canceled", context.Canceled)
	RegisterError("context.deadline", context.DeadlineExceeded)
}

// errorReply turns a handler's error into what goes on the wire. The code
// is that of the outermost registered sentinel in the error's tree, so a
// package's own error wins over a generic one it wraps.
func errorReply(err error) *ErrorReply {
	r := &ErrorReply{Message: err.Error(), Code: codeOf(err)}
	if len(r.Message) > maxMessage {
		r.Message = r.Message[:maxMessage]
	}
	return r
}

func codeOf(err error) string {
	registry.RLock()
	defer registry.RUnlock()
	// Walk the tree breadth first, looking each node up by identity.
	queue := []error{err}
	for len(queue) > 0 {
		e := queue[0]
		queue = queue[1:]
		if e == nil {
			continue
		}
		if reflect.TypeOf(e).Comparable() {
			if code, ok := registry.byErr[e]; ok {
				return code
			}
		}
		switch u := e.(type) {
		case interface{ Unwrap() error }:
			queue = append(queue, u.Unwrap())
		case interface{ Unwrap() []error }:
			queue = append(queue, u.Unwrap()...)
		}
	}
	// Errors with their own Is methods match only this way.
	for _, reg := range registry.list {
		if errors.Is(err, reg.err) {
			return reg.code
		}
	}
	return ""
}

// remoteError turns a received error reply back into an error.
func remoteError(r *ErrorReply) *RemoteError {
	registry.RLock()
	defer registry.RUnlock()
	return &RemoteError{Code: r.Code, Message: r.Message, err: registry.byCode[r.Code]}
}

// gone builds the error that every call fails with once a connection has
// ended for cause: it matches ErrPeerGone and cause.
func gone(cause error) error {
	switch {
	case cause == nil:
		return ErrPeerGone
	case errors.Is(cause, ErrPeerGone), errors.Is(cause, ErrClosed):
		return cause
	}
	return fmt.Errorf("%w: %w", ErrPeerGone, cause)
}
