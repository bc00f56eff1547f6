// Package ipc is the channel between an instance's primary and its
// secondaries: msgpack messages over a unix SOCK_SEQPACKET socket.
//
// # Transport
//
// One message is one datagram, so boundaries are kept without framing, and
// a peer that dies is seen at once as end of file rather than as silence.
// The socket lives in a directory of its own (RuntimeDir), mode 0600; the
// server also checks every peer's credentials (SO_PEERCRED) and refuses
// users other than its own, root, and an allowed list. Messages may carry
// open files (SCM_RIGHTS), which is how a device is shared.
//
// # Frames
//
// A frame is the msgpack array [id, kind, files, body] (see Frame), at most
// MaxMessage bytes. Decoding is strict: an unknown kind, a frame cut short
// or too long, bytes after the body, a body field the message type does
// not have, or a field out of range (see each message's Validate) are all
// errors, and a server closes the connection that sent them while it goes
// on serving everyone else. Containers are bounded (MaxItems) before
// anything is allocated for them.
//
// # Calls and pushes
//
// A Client may have any number of requests in flight from any number of
// goroutines; each carries an id and its answer comes back with it, so
// answers may arrive in any order. The Server runs each request in its own
// goroutine (at most ServerConfig.MaxInflightPerConn at once per
// connection). The server pushes to a client with Peer.Push and waits for
// the acknowledgement; the client handles pushes one at a time in the order
// they came, which memory synchronisation relies on.
//
// # Limits
//
// A server bounds what its peers can make it hold (see Limits): its
// connections in all and per user; the descriptors one request may carry
// and a peer's requests may hold at once; the requests a peer may have
// waiting; how long a reply may wait for a peer that does not read. With
// ServerConfig.HelloKind set, a connection is a stranger until its
// handshake succeeds: descriptors it sends are closed on arrival, it may
// send only small frames, one request at a time, and is closed if it has
// not completed the handshake within Limits.HelloTimeout. All of this is
// checked as frames arrive, before any handler runs. A connection over a
// cap is closed and a request over a descriptor limit refused, both with
// ErrLimit as the reason; Server.Stats counts each limit that tripped,
// and the server logs it (at most once a second per limit).
//
// Every wait has the caller's context as its bound, and none outlives the
// connection: when it ends, every pending and later call fails at once with
// ErrPeerGone. Errors that handlers return travel as a code and a message;
// a code registered with RegisterError comes back as an error that matches
// the same sentinel, so errors.Is works across processes.
package ipc
