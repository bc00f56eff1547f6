package harness

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mpmr/mpmr/internal/sys/sock"
	"github.com/mpmr/mpmr/ipc"
)

// RoleSocketFlood floods the primary's socket from a process of its own,
// as a careless or hostile local peer would (args SocketFloodArgs). It
// speaks to the socket directly, so that it can do what the ipc package
// would not. Its input closing ends it, and its connections with it.
//
//   - Mode FloodIdle opens N connections that never send anything; its
//     readiness data is an IdleFloodReady, and the command "check"
//     answers an IdleFloodCheck.
//   - Mode FloodFiles opens one connection, makes one stats request and
//     never says hello; the command "flood" then sends N stats requests,
//     each with Files descriptors, reads nothing, and answers a
//     FilesFloodResult.
const RoleSocketFlood = "harness-socket-flood"

// Flood modes of RoleSocketFlood.
const (
	FloodIdle  = "idle"
	FloodFiles = "files"
)

func init() { register(RoleSocketFlood, runSocketFlood) }

// SocketFloodArgs configures a RoleSocketFlood helper. With UID set it
// switches to that user (and GID) first.
type SocketFloodArgs struct {
	Socket string `json:"socket"`
	UID    int    `json:"uid,omitempty"`
	GID    int    `json:"gid,omitempty"`
	Mode   string `json:"mode"`
	N      int    `json:"n"`
	Files  int    `json:"files,omitempty"`
}

// IdleFloodReady is how many idle connections were dialled.
type IdleFloodReady struct {
	Opened int `json:"opened"`
}

// IdleFloodCheck says how many of the idle connections the server has
// closed so far, and how many of those it told why: over a limit
// (ipc.ErrLimit) or refused by credentials (ipc.ErrRefused).
type IdleFloodCheck struct {
	Closed  int `json:"closed"`
	Limit   int `json:"limit"`
	Refused int `json:"refused"`
}

// FilesFloodResult is how many requests went out before the server hung
// up (Err), if it did. Refused says the server's socket refused the
// descriptors (sock.ErrRightsRefused): the requests then went without.
type FilesFloodResult struct {
	Sent    int          `json:"sent"`
	Refused bool         `json:"refused,omitempty"`
	Err     *ErrorReport `json:"err,omitempty"`
}

func runSocketFlood(args []byte) int {
	a := helperArgs[SocketFloodArgs](args)
	h := newHelper()
	fail := func(err error) int {
		h.ready(Ready{PID: os.Getpid(), Err: Report(err)})
		return 3
	}
	if a.UID != 0 {
		// Group first: once the uid is dropped the gid cannot change.
		if err := syscall.Setgroups(nil); err != nil {
			return fail(err)
		}
		if err := syscall.Setgid(a.GID); err != nil {
			return fail(err)
		}
		if err := syscall.Setuid(a.UID); err != nil {
			return fail(err)
		}
	}
	switch a.Mode {
	case FloodIdle:
		return floodIdle(h, a)
	case FloodFiles:
		return floodFiles(h, a)
	}
	return fail(fmt.Errorf("harness: unknown socket flood %q", a.Mode))
}

// dialFlood dials path; a flood outruns the server's accept loop, and
// Dial waits for a place in the listen queue (DefaultTimeout at most).
func dialFlood(path string) (*sock.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), DefaultTimeout)
	defer cancel()
	return sock.Dial(ctx, path)
}

func floodIdle(h *helper, a SocketFloodArgs) int {
	var closed, limited, refused atomic.Int64
	for range a.N {
		c, err := dialFlood(a.Socket)
		if err != nil {
			h.ready(Ready{PID: os.Getpid(), Err: Report(err)})
			return 3
		}
		// Watch the connection: the server may say why it ends it.
		go func() {
			defer c.Close()
			buf := make([]byte, ipc.MaxMessage)
			var code string
			for {
				n, files, err := c.Recv(buf)
				for _, f := range files {
					f.Close()
				}
				if err != nil {
					break
				}
				var r ipc.ErrorReply
				if f, err := ipc.ParseFrame(buf[:n]); err == nil && f.ID == 0 && f.Kind == ipc.KindError && ipc.Unmarshal(f.Body, &r) == nil {
					code = r.Code
				}
			}
			switch code {
			case "ipc.limit":
				limited.Add(1)
			case "ipc.refused":
				refused.Add(1)
			}
			closed.Add(1)
		}()
	}
	data, _ := json.Marshal(IdleFloodReady{Opened: a.N})
	h.ready(Ready{PID: os.Getpid(), Data: data})
	h.serve(map[string]command{
		"check": func([]byte) (any, error) {
			return IdleFloodCheck{Closed: int(closed.Load()), Limit: int(limited.Load()), Refused: int(refused.Load())}, nil
		},
	})
	return 0
}

func floodFiles(h *helper, a SocketFloodArgs) int {
	c, err := dialFlood(a.Socket)
	if err != nil {
		h.ready(Ready{PID: os.Getpid(), Err: Report(err)})
		return 3
	}
	defer c.Close()
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		h.ready(Ready{PID: os.Getpid(), Err: Report(err)})
		return 3
	}
	defer devNull.Close()
	files := make([]*os.File, a.Files)
	for i := range files {
		files[i] = devNull
	}
	// One round trip first, so that the server surely has the connection
	// when the test hears it is ready.
	b, _ := ipc.AppendFrame(nil, 1, ipc.KindStats, 0, &ipc.StatsRequest{})
	if err := c.Send(b, nil); err != nil {
		h.ready(Ready{PID: os.Getpid(), Err: Report(err)})
		return 3
	}
	if _, _, err := c.Recv(make([]byte, ipc.MaxMessage)); err != nil {
		h.ready(Ready{PID: os.Getpid(), Err: Report(err)})
		return 3
	}
	h.ready(Ready{PID: os.Getpid()})
	h.serve(map[string]command{
		"flood": func([]byte) (any, error) {
			var r FilesFloodResult
			for i := range a.N {
				send := files
				if r.Refused {
					send = nil // still a peer that sends and reads nothing
				}
				b, err := ipc.AppendFrame(nil, uint64(i+2), ipc.KindStats, len(send), &ipc.StatsRequest{})
				if err == nil {
					err = c.Send(b, send)
				}
				if errors.Is(err, sock.ErrRightsRefused) && !r.Refused {
					r.Refused = true
					continue
				}
				if err != nil {
					r.Err = Report(err)
					break
				}
				r.Sent++
			}
			return r, nil
		},
	})
	return 0
}

// SocketPath returns the path of the scenario's primary socket.
func (s *Scenario) SocketPath() string { return filepath.Join(s.RunDir, s.Prefix, ipc.SocketName) }

// floodPatience bounds how long a test waits for the server to deal with a
// flood.
const floodPatience = 30 * time.Second

// AwaitIdleFlood asks an idle flood helper until the server has closed
// every one of its connections, within a bound, and returns the last
// check.
func AwaitIdleFlood(p *Proc, opened int) (IdleFloodCheck, error) {
	deadline := time.Now().Add(floodPatience)
	for {
		var c IdleFloodCheck
		if err := p.Call("check", nil, &c); err != nil {
			return c, err
		}
		if c.Closed >= opened {
			return c, nil
		}
		if time.Now().After(deadline) {
			return c, fmt.Errorf("harness: the server closed %d of %d idle connections within %v", c.Closed, opened, floodPatience)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
