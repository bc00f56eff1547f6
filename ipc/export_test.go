package ipc

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// HasLane reports whether c has its call lane.
func HasLane(c *Client) bool { return c.lane.Load() != nil }

// SetAfterCheckHook has RemoveDir call f between its check and the removal.
func SetAfterCheckHook(f func()) { afterCheckHook = f }

// LaneChecks counts the times s looked at its bound lanes.
func LaneChecks(s *Server) uint64 { return s.laneChecks.Load() }

// LaneCheckerRunning reports whether s's checker of bound lanes runs.
func LaneCheckerRunning(s *Server) bool {
	s.lanesMu.Lock()
	defer s.lanesMu.Unlock()
	return s.checking
}

// LaneTakes counts the times a lane of s asked for a CPU.
func LaneTakes(s *Server) uint64 { return s.laneTakes.Load() }

// SetLaneIdleAfter sets how long a bound lane's peer may ask nothing
// before the lane gives its CPU to a lane waiting for one; the returned
// function sets it back.
func SetLaneIdleAfter(d time.Duration) (restore func()) {
	old := laneIdleAfter
	laneIdleAfter = d
	return func() { laneIdleAfter = old }
}

// LaneStarvedPerUser is how many lanes of one user's processes may be let
// go for their CPU's load before that user is followed no more.
const LaneStarvedPerUser = laneStarvedPerUser

// BoundLanes counts the lanes s has bound.
func BoundLanes(s *Server) int { return len(s.boundLanes()) }

// ProcessesRemembered counts the processes s keeps let-go counts for.
func ProcessesRemembered(s *Server) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.starved)
}

// StarvedLetGos counts the lanes of process pid that s let go for their
// CPU's load, as the process's count has them.
func StarvedLetGos(s *Server, pid int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for k, c := range s.starved {
		if k.pid == pid {
			n += int(c.n.Load())
		}
	}
	return n
}

// LanesWaiting counts the lanes of s waiting for a CPU they were refused.
func LanesWaiting(s *Server) int {
	s.lanesMu.Lock()
	defer s.lanesMu.Unlock()
	return len(s.waiting)
}

// SetLaneReceivedHook has each call reading a lane call f with its client
// as each message has been received; the returned function unsets it.
func SetLaneReceivedHook(f func(*Client)) (restore func()) {
	laneReceived.Store(&f)
	return func() { laneReceived.Store(nil) }
}

// SetPushSendingHook has each PushWithin with a bound (d > 0) call f with
// the context that bounds its send, as the push is about to be sent; the
// returned function unsets it.
func SetPushSendingHook(f func(context.Context)) (restore func()) {
	pushSending.Store(&f)
	return func() { pushSending.Store(nil) }
}

// SetLaneLookingHook has the watch of bound lanes call f before each of
// its looks; the returned function unsets it.
func SetLaneLookingHook(f func()) (restore func()) {
	laneLooking.Store(&f)
	return func() { laneLooking.Store(nil) }
}

// BoundLaneCPUs returns the CPUs of the lanes s has bound, oldest first.
func BoundLaneCPUs(s *Server) []int {
	var cpus []int
	for _, l := range s.boundLanes() {
		cpus = append(cpus, l.cpu)
	}
	return cpus
}

// CatchUpWait is how long a call or push past its bound waits for what
// could still be on time.
const CatchUpWait = catchUpWait

// HoldNextFrame has the next frame a connection's reader takes, on the
// server's side if server is set and the client's if not, wait, taken off
// the socket and not yet handled, until gate is closed; the returned
// channel is closed once the reader holds it.
func HoldNextFrame(gate <-chan struct{}, server bool) (held <-chan struct{}) {
	h := make(chan struct{})
	var once sync.Once
	f := func(side bool) {
		if side != server {
			return
		}
		once.Do(func() {
			close(h)
			<-gate
		})
	}
	frameTaken.Store(&f)
	return h
}

// OnSendToClosedPeer has f run when a send finds the peer's end closed,
// before the caller waits for the connection's end; nil undoes it, and
// HoldNextFrame too.
func OnSendToClosedPeer(f func()) {
	if f == nil {
		sentToClosed.Store(nil)
		frameTaken.Store(nil)
		return
	}
	sentToClosed.Store(&f)
}

// SetPeerClosedGrace sets how long a send that found the peer's end closed
// waits for the reader to say why; the returned function sets it back.
func SetPeerClosedGrace(d time.Duration) (restore func()) {
	old := peerClosedGrace
	peerClosedGrace = d
	return func() { peerClosedGrace = old }
}

// HoldNewConnections has the goroutines of connections accepted from now
// on wait, before they become peers, until gate is closed; nil gate undoes
// it.
func HoldNewConnections(gate <-chan struct{}) { holdAt(&connServing, gate) }

// HoldShedDrops has the closing of connections shed from now on wait
// until gate is closed; nil gate undoes it.
func HoldShedDrops(gate <-chan struct{}) { holdAt(&shedDropping, gate) }

// holdAt sets hook to wait until gate is closed, or unsets it if gate is
// nil.
func holdAt(hook *atomic.Pointer[func()], gate <-chan struct{}) {
	if gate == nil {
		hook.Store(nil)
		return
	}
	f := func() { <-gate }
	hook.Store(&f)
}
