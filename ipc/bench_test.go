package ipc_test

import (
	"context"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
)

// reportLatency reports the median and 99th percentile of per-iteration
// round trips. Compare with the C floor measured in the same run
// (../shared/anchors/run pingpong: two processes blocking in recv on a
// seqpacket pair): the bare call aims at p50 <= 1.3x its p50.
func reportLatency(b *testing.B, d []time.Duration) {
	if len(d) == 0 {
		return
	}
	slices.Sort(d)
	b.ReportMetric(float64(d[len(d)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(d[len(d)*99/100].Nanoseconds())/1e3, "p99-µs")
}

// benchCalls times b.N calls; idle is how long to wait before each, the
// quiet that makes every call a cold one.
func benchCalls(b *testing.B, path string, spin, idle time.Duration) {
	c := dial(b, path, ipc.ClientConfig{Spin: spin})
	ctx := context.Background()
	req := &ipc.CreateMR{Addr: 0x7f00_1234_5000}
	var reply ipc.CreateMRReply
	if err := c.Call(ctx, ipc.KindCreateMR, req, &reply); err != nil { // connect and warm up
		b.Fatal(err)
	}
	d := make([]time.Duration, b.N)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		if idle > 0 {
			time.Sleep(idle) // the workload's quiet, not a synchronisation
		}
		start := time.Now()
		if err := c.Call(ctx, ipc.KindCreateMR, req, &reply); err != nil {
			b.Fatal(err)
		}
		d[i] = time.Since(start)
	}
	b.StopTimer()
	reportLatency(b, d)
}

// A create-MR request answered at once (no registration): the channel's
// own share of the round trip.
func BenchmarkCall(b *testing.B) {
	b.Run("in-process", func(b *testing.B) {
		s := startServer(b, newHandler())
		benchCalls(b, s.path, 0, 0)
	})
	// The other process's server and this client poll for the next frame
	// for spin before they sleep; the server answers on the lane's reader
	// ("inline", as the primary answers creates) or on a goroutine of
	// the request's own.
	for _, spin := range []time.Duration{0, 50 * time.Microsecond} {
		for _, inline := range []string{"inline", "goroutine"} {
			b.Run("other-process/spin="+spin.String()+"/"+inline, func(b *testing.B) {
				path := filepath.Join(b.TempDir(), ipc.SocketName)
				srv := testproc.Start(b, "serve", []string{path, spin.String(), inline})
				srv.Expect("ready", 0)
				benchCalls(b, path, spin, 0)
			})
		}
	}
}

// BenchmarkCallIdle is the bare call of BenchmarkCall after 20 ms of
// quiet, as a secondary's miss after memory churn is (see the main job):
// both processes' threads, and the virtual CPUs they ran on, have gone
// to sleep. Compare with primary's BenchmarkCreateMRRoundTrip/*/new/idle:
// what a cold create costs beyond this is the registration's. (Each
// iteration takes 20 ms: give it a count, -benchtime 200x.)
func BenchmarkCallIdle(b *testing.B) {
	path := filepath.Join(b.TempDir(), ipc.SocketName)
	srv := testproc.Start(b, "serve", []string{path, "0s", "inline"})
	srv.Expect("ready", 0)
	benchCalls(b, path, 0, 20*time.Millisecond)
}

// Calls from several goroutines share one connection.
func BenchmarkCallParallel(b *testing.B) {
	s := startServer(b, newHandler())
	c := dial(b, s.path, ipc.ClientConfig{})
	ctx := context.Background()
	b.ReportAllocs()
	b.SetParallelism(4)
	b.RunParallel(func(pb *testing.PB) {
		var reply ipc.CreateMRReply
		for pb.Next() {
			if err := c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1000}, &reply); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// A sync push and its acknowledgement.
func BenchmarkPush(b *testing.B) {
	p := syncAckingPeer(b)
	ctx := context.Background()
	msg := &ipc.Sync{Op: ipc.SyncMap, List: 1, First: 100, Count: 8}
	var ack ipc.SyncAck
	d := make([]time.Duration, b.N)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		start := time.Now()
		if err := p.Push(ctx, ipc.KindSync, msg, &ack); err != nil {
			b.Fatal(err)
		}
		d[i] = time.Since(start)
	}
	b.StopTimer()
	reportLatency(b, d)
}

// The codec's share: encode a frame, parse it, decode its body.
func BenchmarkFrameRoundTrip(b *testing.B) {
	buf := make([]byte, 0, 64)
	var m ipc.CreateMR
	b.ReportAllocs()
	for b.Loop() {
		fb, err := ipc.AppendFrame(buf[:0], 12345, ipc.KindCreateMR, 0, &ipc.CreateMR{Addr: 0x7f00_1234_5000})
		if err != nil {
			b.Fatal(err)
		}
		f, err := ipc.ParseFrame(fb)
		if err != nil {
			b.Fatal(err)
		}
		if err := ipc.Unmarshal(f.Body, &m); err != nil {
			b.Fatal(err)
		}
	}
}
