package secondary

import (
	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// Counters are a process's counters: its queues' lookups by level, create
// requests with their round-trip times, and memory syncs applied.
type Counters = instance.Counters

// Stats is a snapshot of what this secondary did and sees.
type Stats struct {
	Counters Counters
	Global   cache.GlobalStats
	Device   verbs.SoftStats // zero unless the primary uses the soft device
}

// Stats publishes this process's counters and returns a snapshot.
func (s *Secondary) Stats() Stats {
	s.useMu.RLock()
	defer s.useMu.RUnlock()
	if s.closed.Load() {
		return Stats{} // the segment is gone, and with it what it counted
	}
	st := Stats{Counters: s.publish(), Global: s.global.Stats()}
	if s.dev != nil {
		st.Device = s.dev.Stats()
	}
	return st
}

// ReportValidationErrors adds n to the validation errors this process
// publishes: failures of the device's checks the application saw.
func (s *Secondary) ReportValidationErrors(n uint64) { s.valErrs.Add(n) }

// publish writes the counters into this process's line of the segment,
// where tools and the primary read them.
func (s *Secondary) publish() Counters {
	var c Counters
	c.SetQueues(s.queues.Sum())
	c.Requests = s.requests.Load()
	c.RequestErrors = s.reqErrs.Load()
	c.SetLatency(&s.rtt)
	c.Syncs = s.syncs.Load()
	c.ValidationErrors = s.valErrs.Load()
	s.ctrs.Publish(shm.RoleSecondary, c)
	return c
}
