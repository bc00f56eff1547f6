package ipc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/mpmr/mpmr/internal/sys/sock"
)

// SocketName is the file name of an instance's socket in its runtime
// directory.
const SocketName = "ipc.sock"

// ValidatePrefix checks an instance prefix: 1 to 64 ASCII letters, digits,
// '-', '_' or '.', and not "." or anything containing "..".
func ValidatePrefix(prefix string) error {
	if len(prefix) == 0 || len(prefix) > 64 || prefix == "." || strings.Contains(prefix, "..") {
		return fmt.Errorf("%w: %q", ErrBadPrefix, prefix)
	}
	for _, c := range []byte(prefix) {
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '-', c == '_', c == '.':
		default:
			return fmt.Errorf("%w: %q has %q", ErrBadPrefix, prefix, c)
		}
	}
	return nil
}

// RuntimeDir returns the directory of instance prefix's runtime files:
// $XDG_RUNTIME_DIR/mpmr/<prefix> when that variable holds an absolute path,
// else /run/mpmr/<prefix> for root, else $TMPDIR/mpmr-<uid>/<prefix>. It
// neither creates nor checks it: OpenRunDir does both, refusing a path
// that another user could have made (such as a /tmp/mpmr-<uid> that
// someone else created first).
func RuntimeDir(prefix string) (string, error) {
	if err := ValidatePrefix(prefix); err != nil {
		return "", err
	}
	if x := os.Getenv("XDG_RUNTIME_DIR"); filepath.IsAbs(x) {
		return filepath.Join(x, "mpmr", prefix), nil
	}
	if uid := os.Geteuid(); uid != 0 {
		return filepath.Join(os.TempDir(), "mpmr-"+strconv.Itoa(uid), prefix), nil
	}
	return filepath.Join("/run/mpmr", prefix), nil
}

// SocketPath returns the socket path of instance prefix: SocketName in
// its RuntimeDir.
func SocketPath(prefix string) (string, error) {
	dir, err := RuntimeDir(prefix)
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, SocketName), nil
}

// Cred is a peer's identity as the kernel recorded it when the connection
// was made (SO_PEERCRED): the connecting process for a server's peer, the
// listening process for a client's server. A plain value.
type Cred struct {
	PID int
	UID int
	GID int
}

// Listener is a listening socket of mode 0600. Safe for concurrent use.
type Listener struct {
	l    *sock.Listener
	path string
	fi   fs.FileInfo // the socket file as created, to remove only ours
	once sync.Once
	err  error
}

// Listen creates a listening socket at path, creating its directory (mode
// 0700) when missing. The directory must be owned by this user or root and
// not writable by others (unless sticky), and so must every directory on
// the way to it (see RunDir), else ErrPermission. A socket file
// left at path by a server that ended is replaced; one that a live server
// listens on fails with ErrAddressInUse, and so does any other kind of
// file.
//
// Checking whether a server is live means connecting to it: that server
// sees a connection come and go. Listen does not make the check-and-replace
// atomic against another process doing the same: one server per path is
// the caller's policy (a lock file, as the primary's). A server killed an
// instant ago may still hold its listening socket until its exit completes.
func Listen(path string) (*Listener, error) { return listen(path, false) }

// ListenNoFiles is Listen for a server whose peers may send no
// descriptors (Limits.MaxFilesPerMessage negative): the kernel fails a
// peer's send of any with EPERM, from the moment it connects
// (SO_PASSRIGHTS, Linux 6.16 on; RefusesFiles says whether it does). A
// descriptor the server must close is one whose close its sender may
// hold up: the last close of a TCP socket set to linger waits for its
// unsent data, and a close of a socket with such a descriptor still queued
// on it too. On older kernels they come as on Listen's, and the server
// drops them on arrival, sockets among them made to close at once; see
// the README's "Not defended" for what that leaves.
func ListenNoFiles(path string) (*Listener, error) { return listen(path, true) }

// RefusesFiles reports whether the kernel refuses descriptors sent on the
// connections l accepts (see ListenNoFiles).
func (l *Listener) RefusesFiles() bool { return l.l.RefusesRights() }

func listen(path string, noFiles bool) (*Listener, error) {
	c := checker{uid: os.Geteuid(), create: true}
	d, err := c.open(filepath.Dir(path), false, true)
	if err != nil {
		return nil, fmt.Errorf("ipc: listen: %w", err)
	}
	d.Close()
	l, err := sock.Listen(path, noFiles)
	if errors.Is(err, sock.ErrAddressInUse) {
		if err := removeStale(path); err != nil {
			return nil, err
		}
		l, err = sock.Listen(path, noFiles)
	}
	if errors.Is(err, sock.ErrAddressInUse) {
		return nil, fmt.Errorf("%w: %s", ErrAddressInUse, path)
	}
	if err != nil {
		return nil, fmt.Errorf("ipc: %w", err)
	}
	fi, err := os.Lstat(path)
	if err == nil {
		err = os.Chmod(path, 0o600)
	}
	if err != nil {
		l.Close()
		return nil, fmt.Errorf("ipc: listen: %w", err)
	}
	return &Listener{l: l, path: path, fi: fi}, nil
}

// removeStale removes the socket file at path if nobody listens on it.
func removeStale(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil // gone meanwhile
	}
	if err != nil {
		return fmt.Errorf("ipc: listen: %w", err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%w: %s exists and is not a socket", ErrAddressInUse, path)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	c, err := sock.Dial(ctx, path)
	switch {
	case err == nil:
		c.Close()
		return fmt.Errorf("%w: %s", ErrAddressInUse, path)
	case errors.Is(err, sock.ErrRefused):
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("ipc: remove stale socket: %w", err)
		}
		return nil
	case errors.Is(err, sock.ErrNoSocket):
		return nil
	}
	return fmt.Errorf("ipc: probe %s: %w", path, err)
}

// Path returns the socket path.
func (l *Listener) Path() string { return l.path }

// Accept waits for the next connection. After Close it fails with
// ErrClosed. A Server calls it; use it directly only without one.
func (l *Listener) Accept() (*Conn, error) {
	c, err := l.l.Accept()
	if err != nil {
		if sock.IsClosed(err) {
			return nil, ErrClosed
		}
		return nil, fmt.Errorf("ipc: %w", err)
	}
	return &Conn{c: c}, nil
}

// Close stops listening and removes the socket file, unless another
// listener has replaced it meanwhile. Idempotent.
func (l *Listener) Close() error {
	l.once.Do(func() {
		l.err = l.l.Close()
		if fi, err := os.Lstat(l.path); err == nil && os.SameFile(fi, l.fi) {
			if err := os.Remove(l.path); err != nil && l.err == nil {
				l.err = fmt.Errorf("ipc: remove socket: %w", err)
			}
		}
	})
	return l.err
}

// Conn is one connection, client or server side, before a Client or Server
// takes it over: from then on they own it. Safe for concurrent use.
type Conn struct {
	c *sock.Conn
}

// Dial connects to the server listening at path. It fails with
// ErrNotListening when nobody listens there, and with ErrBusy when the
// server's queue of connections stays full until ctx ends (it waits for
// a place until then).
func Dial(ctx context.Context, path string) (*Conn, error) {
	c, err := sock.Dial(ctx, path)
	if err != nil {
		if errors.Is(err, sock.ErrNoSocket) || errors.Is(err, sock.ErrRefused) {
			return nil, fmt.Errorf("%w: %w", ErrNotListening, err)
		}
		if errors.Is(err, sock.ErrBusy) {
			return nil, fmt.Errorf("%w: %w", ErrBusy, err)
		}
		return nil, fmt.Errorf("ipc: %w", err)
	}
	return &Conn{c: c}, nil
}

// PeerCred returns the credentials of the process at the other end: for a
// dialled connection, the server that was listening.
func (c *Conn) PeerCred() (Cred, error) {
	cred, err := c.c.PeerCred()
	return Cred(cred), err
}

// Close closes the connection. Idempotent.
func (c *Conn) Close() error { return c.c.Close() }

// send writes one frame. b must not exceed MaxMessage.
func (c *Conn) send(b []byte, files []*os.File, deadline time.Time) error {
	if err := c.c.SetWriteDeadline(deadline); err != nil {
		return connErr(err)
	}
	return connErr(c.c.Send(b, files))
}

// trySend writes one frame if the peer's queue has room for it now,
// whatever the write deadline (sock.Conn.TrySend).
func (c *Conn) trySend(b []byte, files []*os.File) error {
	return connErr(c.c.TrySend(b, files))
}

// caughtUp reports whether the connection's reader has taken everything
// queued (sock.Conn.CaughtUp).
func (c *Conn) caughtUp() bool { return c.c.CaughtUp() }

// hungUp reports whether the peer has closed its end (sock.Conn.HungUp).
func (c *Conn) hungUp() bool { return c.c.HungUp() }

// interruptSend makes a blocked send fail with os.ErrDeadlineExceeded.
func (c *Conn) interruptSend() { _ = c.c.SetWriteDeadline(time.Unix(1, 0)) }

// recv reads one frame into b; a longer one fails with ErrTooLarge.
func (c *Conn) recv(b []byte) (int, []*os.File, error) {
	n, files, err := c.c.Recv(b)
	if errors.Is(err, sock.ErrTruncated) {
		return 0, nil, fmt.Errorf("%w: frame longer than %d bytes", ErrTooLarge, len(b))
	}
	return n, files, connErr(err)
}

// connErr maps transport errors to this package's.
func connErr(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, io.EOF), errors.Is(err, sock.ErrPeerClosed):
		return ErrPeerGone
	case sock.IsClosed(err):
		return ErrClosed
	case errors.Is(err, sock.ErrTruncated):
		return fmt.Errorf("%w: frame longer than %d bytes", ErrTooLarge, MaxMessage)
	case errors.Is(err, sock.ErrTooManyFiles):
		return fmt.Errorf("%w: %w", ErrMalformed, err)
	case errors.Is(err, sock.ErrRightsRefused):
		return ErrFilesRefused
	}
	return fmt.Errorf("ipc: %w", err)
}
