package ipc

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
