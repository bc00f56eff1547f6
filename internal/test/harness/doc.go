// Package harness runs an mpmr instance as real processes for the scenario
// tests (internal/test/scenario): a primary, in the test process or as a helper
// process, and secondaries, which are the test binary re-executed in a
// role (the pattern of internal/test/testproc, whose helpers Main still runs;
// unlike those, a harness helper is shut down cleanly when its test ends,
// so that the final check sees what a clean shutdown leaves). It drives
// them with command lines, kills any of them with SIGKILL at a moment the
// test picks, collects what each reports, and checks at the end of every
// scenario that nothing is left.
//
// # Using it
//
// A test package calls Main from its TestMain, so that the roles this
// package registers can run. A test then makes a Scenario on a backend:
//
//	s := harness.New(t, testenv.Tmpfs(t))
//	p := s.StartPrimary()                // in this process, closed at the end
//	sec := s.StartSecondary()            // a process, attached once this returns
//	var k harness.KeyReply
//	sec.MustCall("lookup", harness.Addr{Addr: a}, &k)
//	killedAt := sec.Kill()               // SIGKILL, and reaped
//
// # Helper processes
//
// A helper prints lines of the form "word JSON": one readiness line first
// ("ready", a Ready), one answer per command it reads ("> ", an error or
// data), and events in between ("event", an Event such as "holding" or
// "waiting"). Errors cross the process boundary as an ErrorReport that
// lists the sentinels they match, so a test can ask whether a secondary's
// attach failed with shm.ErrBadMagic. Results are JSON too (WorkResult,
// HammerResult, ...). When its input closes a helper shuts down cleanly.
//
// # Cross-process invalidation checks
//
// A Board in the control segment lets the primary publish rounds: a region
// allocated and registered, then freed, with the count of finished Frees
// the secondaries read before each lookup. A workload (WorkSpec) judges
// every lookup against it: a lookup that started after a round's Free
// returned must not return that round's key, and a key of a live round
// must validate on the soft device.
//
// # The final check
//
// When the test ends, helpers get their input closed and must end by
// themselves (else they are killed: a test error), in-process runtimes are
// closed, and then the scenario must have left nothing: no process tagged
// with its id (children included), no file of the instance in the runtime
// directory or the backend directory (segment mpmr.NAME.ctl, memseg
// files mpmr.NAME.msl*, life file mpmr.NAME.live, where NAME is
// Scenario.Name; socket, locks, instance.json, backends), no mapping or descriptor
// of them in the test process,
// and on hugetlbfs as many free
// hugepages as before, waiting a bounded time for the kernel and
// discounting pages other users' files took meanwhile. What is found is
// reported as test errors and removed.
//
// Timing goals are for benchmarks; scenarios only bound their waits to
// catch hangs, and log the distributions they measure.
package harness
