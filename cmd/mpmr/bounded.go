package main

import (
	"errors"
	"fmt"
	"time"
)

// fsWait bounds how long the tool works on one instance's files. The
// instance's user chooses where they are (its runtime directory, the
// backend directory in its description), and a file system that does not
// answer — a FUSE server that is stopped, a hung network mount — would
// otherwise hang the tool, and with it every other instance's line in ls.
var fsWait = 5 * time.Second

// catchUp is how long answered still looks for f's result once its time
// is up: the tool itself may have been the one stopped (a job-control
// stop, a debugger, a loaded machine), with f done or about done when it
// runs again, and its timer fired first.
const catchUp = 100 * time.Millisecond

// errNoAnswer says that an instance's files did not answer within fsWait.
var errNoAnswer = errors.New("its files do not answer")

// answered runs f on a goroutine of its own and returns what f returns,
// or errNoAnswer once fsWait, and extra for what f waits for by design,
// have passed (and a moment more: see catchUp). f is then left to finish, or not, by itself, until the
// tool exits: it must not share anything the caller goes on to read or
// write.
func answered[R any](what string, extra time.Duration, f func() (R, error)) (R, error) {
	type result struct {
		r   R
		err error
	}
	done := make(chan result, 1)
	go func() {
		r, err := f()
		done <- result{r, err}
	}()
	wait := fsWait + extra
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case res := <-done:
		return res.r, res.err
	case <-timer.C:
	}
	timer.Reset(catchUp)
	select {
	case res := <-done:
		return res.r, res.err
	case <-timer.C:
		var zero R
		return zero, fmt.Errorf("%s: %w within %v (a file system that does not answer: a stopped FUSE server, "+
			"a hung network mount?); left alone", what, errNoAnswer, wait)
	}
}
