package ipc_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/mpmr/mpmr/ipc"
)

// createHandler answers create-MR requests with the 4 KiB page around the
// address.
type createHandler struct{}

func (createHandler) Connected(p *ipc.Peer)               {}
func (createHandler) Disconnected(p *ipc.Peer, err error) {}

func (createHandler) Handle(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error) {
	if kind != ipc.KindCreateMR {
		return nil, fmt.Errorf("%s is not served here", kind)
	}
	var req ipc.CreateMR
	if err := body.Decode(&req); err != nil {
		return nil, err // the connection is closed instead of answered
	}
	start := req.Addr &^ 0xfff
	return &ipc.CreateMRReply{Start: start, End: start + 0x1000, LKey: 42}, nil
}

// A server and a client in one process; in real use they are the primary
// and a secondary, and the path comes from ipc.SocketPath(prefix).
func Example() {
	dir, _ := os.MkdirTemp("", "ipc-example-")
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, ipc.SocketName)

	l, err := ipc.Listen(path)
	if err != nil {
		fmt.Println(err)
		return
	}
	srv, _ := ipc.NewServer(ipc.ServerConfig{Listener: l, Handler: createHandler{}})
	go srv.Serve(context.Background())
	defer srv.Close()

	ctx := context.Background()
	c, err := ipc.DialClient(ctx, path, ipc.ClientConfig{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer c.Close()
	var reply ipc.CreateMRReply
	if err := c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x7f00_0000_1234}, &reply); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("[0x%x, 0x%x) lkey %d\n", reply.Start, reply.End, reply.LKey)
	// Output: [0x7f0000001000, 0x7f0000002000) lkey 42
}
