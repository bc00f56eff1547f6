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

// waitSlice is how the tool waits for an instance's files: in slices,
// each counted for at most its length. The tool itself may be stopped
// meanwhile (a job-control stop, a debugger, a loaded machine); such a
// stop then costs the files one slice of their time, not all of it.
const waitSlice = 50 * time.Millisecond

// errNoAnswer says that an instance's files did not answer within fsWait.
var errNoAnswer = errors.New("its files do not answer")

// answered runs f on a goroutine of its own and returns what f returns,
// or errNoAnswer once fsWait, and extra for what f waits for by design,
// have passed, not counting a stop of the tool's own (see waitSlice). f
// is then left to finish, or not, by itself, until the tool exits: it
// must not share anything the caller goes on to read or write.
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
	timer := time.NewTimer(min(waitSlice, wait))
	defer timer.Stop()
	var waited time.Duration
	for {
		from := time.Now()
		select {
		case res := <-done:
			return res.r, res.err
		case <-timer.C:
		}
		if waited += min(time.Since(from), waitSlice); waited < wait {
			timer.Reset(min(waitSlice, wait-waited))
			continue
		}
		var zero R
		return zero, fmt.Errorf("%s: %w within %v (a file system that does not answer: a stopped FUSE server, "+
			"a hung network mount?); left alone", what, errNoAnswer, wait)
	}
}
