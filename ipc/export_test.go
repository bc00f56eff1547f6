package ipc

// HasLane reports whether c has its call lane.
func HasLane(c *Client) bool { return c.lane.Load() != nil }
