package ipc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// maxPushQueue bounds the pushes a client holds while its handler is busy.
// The server waits for each acknowledgement, so a well-behaved one never
// has more than a few outstanding.
const maxPushQueue = 1024

// PushHandler handles the pushes a server sends to a Client. A client calls
// it from one goroutine, one push at a time, in arrival order, so an
// implementation needs no locking against itself; what it returns is sent
// back as the acknowledgement (a reply, or an error). ctx ends with the
// connection. If decoding the body fails, the client drops the connection
// instead of acknowledging.
type PushHandler interface {
	HandlePush(ctx context.Context, kind Kind, body *Decoder) (reply any, err error)
}

// PushHandlerFunc adapts a function to PushHandler. Called as PushHandler
// says: one push at a time.
type PushHandlerFunc func(ctx context.Context, kind Kind, body *Decoder) (any, error)

// HandlePush calls f.
func (f PushHandlerFunc) HandlePush(ctx context.Context, kind Kind, body *Decoder) (any, error) {
	return f(ctx, kind, body)
}

// ClientConfig configures a Client. NewClient copies it.
type ClientConfig struct {
	// PushHandler handles the server's pushes. Without one, each push is
	// answered with ErrNoHandler.
	PushHandler PushHandler
	// Logger receives protocol violations of the server. Default
	// slog.Default().
	Logger *slog.Logger
	// WriteTimeout bounds how long a frame waits for room in the server's
	// receive queue when the call's context has no earlier deadline.
	// Default DefaultWriteTimeout.
	WriteTimeout time.Duration
	// Spin is how long the reader polls for the next frame before it
	// sleeps (see sock.Conn.SpinReadable): an answer that comes within it
	// reaches its caller without a cross-CPU wake-up. 0 never polls.
	Spin time.Duration
}

// Client is the calling end of a connection: any number of goroutines may
// Call at once, each answer finds its caller by request id, and pushes
// from the server go to the PushHandler. Safe for concurrent use.
type Client struct {
	endpoint
	push    PushHandler
	cred    Cred // the server's, read at the start
	credErr error

	reader sync.WaitGroup

	pmu        sync.Mutex
	pushes     []message // received, not yet handled, in arrival order
	pushesDone bool      // the push loop has ended: later pushes are dropped
	pushReady  chan struct{}
}

// NewClient takes over conn and starts reading from it.
func NewClient(conn *Conn, cfg ClientConfig) (*Client, error) {
	if conn == nil {
		return nil, errors.New("ipc: NewClient needs a connection")
	}
	c := &Client{push: cfg.PushHandler, pushReady: make(chan struct{}, 1)}
	c.cred, c.credErr = conn.PeerCred()
	c.init(conn, cfg.Logger, cfg.WriteTimeout)
	c.spin = cfg.Spin
	c.reader.Add(1)
	go c.read()
	go c.pushLoop()
	return c, nil
}

// DialClient dials path and returns a Client on the connection.
func DialClient(ctx context.Context, path string, cfg ClientConfig) (*Client, error) {
	conn, err := Dial(ctx, path)
	if err != nil {
		return nil, err
	}
	return NewClient(conn, cfg)
}

// Call sends a request of kind and waits for the answer, decoded into reply
// (nil to ignore it, or a *WithFiles to receive files too), until ctx
// ends. The server's error comes back as a *RemoteError that matches its
// registered sentinel. When the connection ends, every pending and later
// Call fails at once with an error matching ErrPeerGone (ErrClosed after
// Close). An answer that arrives after ctx ended is dropped.
func (c *Client) Call(ctx context.Context, kind Kind, req, reply any) error {
	if !kind.IsRequest() {
		return fmt.Errorf("%w: %s is not a request", ErrUnknownKind, kind)
	}
	return c.call(ctx, kind, req, reply)
}

// Done returns a channel closed when the connection has ended.
func (c *Client) Done() <-chan struct{} { return c.done }

// Err returns why the connection ended, or nil while it is open.
func (c *Client) Err() error { return c.endpoint.Err() }

// ServerCred returns the credentials of the server process, as the kernel
// recorded them when it started listening. They are read when the client
// is made, so they are there even after the connection has ended (a
// server that refused it, say).
func (c *Client) ServerCred() (Cred, error) { return c.cred, c.credErr }

// Close closes the connection; pending calls fail with ErrClosed. It waits
// for the reading goroutine, not for a push handler that is running (its
// context is cancelled). Idempotent.
func (c *Client) Close() error {
	c.fail(ErrClosed)
	c.reader.Wait()
	return nil
}

func (c *Client) read() {
	defer c.reader.Done()
	err := c.readLoop(c.incoming)
	c.fail(err)
	if err = c.Err(); isViolation(err) {
		c.log.Warn("ipc: closed the connection of a server that broke the protocol", "err", err)
	}
}

// incoming queues a push for the push loop; it never blocks.
func (c *Client) incoming(f Frame, files []*os.File) error {
	if !f.Kind.IsPush() {
		closeFiles(files)
		return fmt.Errorf("%w: %s from the server", ErrUnknownKind, f.Kind)
	}
	c.pmu.Lock()
	if c.pushesDone {
		c.pmu.Unlock()
		closeFiles(files)
		return nil // the connection has ended: nobody handles it
	}
	if len(c.pushes) >= maxPushQueue {
		c.pmu.Unlock()
		closeFiles(files)
		return fmt.Errorf("%w: %d pushes waiting", ErrBacklog, len(c.pushes))
	}
	c.pushes = append(c.pushes, message{id: f.ID, kind: f.Kind, body: bytes.Clone(f.Body), files: files})
	c.pmu.Unlock()
	select {
	case c.pushReady <- struct{}{}:
	default:
	}
	return nil
}

// pushLoop handles pushes one at a time, in arrival order, until the
// connection ends. It watches done, which is closed as soon as the end is
// decided, whoever decides it: the reader, a writer, or Close.
func (c *Client) pushLoop() {
	for {
		select {
		case <-c.pushReady:
		case <-c.done:
		}
		for {
			m, ok := c.nextPush()
			if !ok {
				break
			}
			c.handlePush(m)
		}
		select {
		case <-c.done:
			c.pmu.Lock()
			for _, m := range c.pushes {
				closeFiles(m.files)
			}
			c.pushes, c.pushesDone = nil, true
			c.pmu.Unlock()
			return
		default:
		}
	}
}

// nextPush takes the oldest push waiting, if any.
func (c *Client) nextPush() (message, bool) {
	c.pmu.Lock()
	defer c.pmu.Unlock()
	if len(c.pushes) == 0 {
		return message{}, false
	}
	m := c.pushes[0]
	c.pushes[0] = message{}
	c.pushes = c.pushes[1:]
	return m, true
}

func (c *Client) handlePush(m message) {
	select {
	case <-c.done: // ended: nobody to acknowledge
		closeFiles(m.files)
		return
	default:
	}
	d := &Decoder{body: m.body, files: m.files}
	var reply any
	var err error
	if c.push == nil {
		err = fmt.Errorf("%w: %s push", ErrNoHandler, m.kind)
	} else {
		reply, err = c.push.HandlePush(c.ctx, m.kind, d)
	}
	d.release()
	if d.err != nil {
		c.log.Warn("ipc: closed the connection of a server that sent a malformed push", "kind", m.kind, "err", d.err)
		c.fail(fmt.Errorf("%s push: %w", m.kind, d.err))
		return
	}
	ctx := context.Background()
	if err != nil {
		err = c.write(ctx, m.id, KindError, errorReply(err))
	} else if err = c.write(ctx, m.id, KindReply, reply); err != nil && c.ctx.Err() == nil {
		err = c.write(ctx, m.id, KindError, errorReply(fmt.Errorf("ipc: %s acknowledgement: %w", m.kind, err)))
	}
	if err != nil && c.ctx.Err() == nil {
		c.log.Error("ipc: acknowledgement could not be sent", "kind", m.kind, "err", err)
	}
}
