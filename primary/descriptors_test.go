package primary_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
)

func init() { testproc.Register("lingering-fd", helperLingeringFD) }

// helperLingeringFD becomes uid args[0] (unless "-"), connects to the
// unix socket args[1] and sends a stats request, no hello before it,
// carrying the sending end of a TCP connection whose last close waits up
// to ten minutes (testenv.LingeringTCP). It says "sent ERR", then closes
// its own copy, then keeps the connection's peer open, reading nothing,
// until its input ends; then "closed" and it exits.
func helperLingeringFD(args []string) int {
	if args[0] != "-" {
		uid, _ := strconv.Atoi(args[0])
		if err := testenv.BecomeUser(uid); err != nil {
			testproc.Say("sent %v", err)
			return 3
		}
	}
	sender, peer, err := testenv.LingeringTCP(10 * time.Minute)
	if err != nil {
		testproc.Say("sent %v", err)
		return 3
	}
	c, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err == nil {
		err = unix.Connect(c, &unix.SockaddrUnix{Name: args[1]})
	}
	if err == nil {
		var b []byte
		if b, err = ipc.AppendFrame(nil, 1, ipc.KindStats, 1, &ipc.StatsRequest{}); err == nil {
			_, err = unix.SendmsgN(c, b, unix.UnixRights(int(sender.Fd())), nil, 0)
		}
	}
	testproc.Say("sent %v", err)
	if err != nil {
		// This copy is the last: let the peer go first, or its close
		// waits.
		peer.Close()
	}
	sender.Close()
	in := testproc.Commands()
	for in.Scan() {
	}
	peer.Close()
	testproc.Say("closed")
	return 0
}

// Closing a descriptor can wait on whoever sent it: the last close of a
// TCP socket set to linger waits, as long as its linger says, for the data
// it could not send. A peer that sent the primary one (a user not let in,
// on an instance opened to others; or the instance's own user, before its
// hello) made the thread that dropped it, and the primary's Close after
// it, wait until the peer let its end go. The primary takes no
// descriptors: where the kernel can refuse them, the peer's send fails
// (EPERM); elsewhere the primary resets the sockets it drops. Either way
// Close returns while the peer holds on.
func TestNoPeerMakesThePrimaryWaitOnADescriptor(t *testing.T) {
	for _, c := range []struct {
		name string
		uid  string
	}{{"a user not let in", strconv.Itoa(breakerAllowedUID + 1)}, {"this user before its hello", "-"}} {
		t.Run(c.name, func(t *testing.T) {
			if c.uid != "-" {
				requireRoot(t)
			}
			p, _, sock := floodablePrimary(t)
			h := testproc.Start(t, "lingering-fd", []string{c.uid, sock})
			sent := h.Expect("sent ", 0)
			if testenv.KernelRefusesRights() {
				assert.Contains(t, sent, unix.EPERM.Error(), "the kernel refuses a descriptor sent to the primary")
			} else {
				require.Equal(t, "sent <nil>", sent)
			}
			_, err := testenv.Bounded(t, "the primary's Close", testproc.DefaultTimeout, p.Close)
			assert.NoError(t, err)
			h.CloseInput()
			h.Expect("closed", 0)
			require.NoError(t, h.Wait(0))
		})
	}
}
