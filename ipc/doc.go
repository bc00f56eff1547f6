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
// anything is allocated for them. The messages of the miss and sync
// paths (CreateMR, CreateMRReply, Sync, SyncAck), and the large ones of
// mempool registrations (RegisterMempool, RegisterMempoolReply), and the
// cancellations a peer may send by the thousand (Cancel), encode and
// decode their canonical form by hand, byte for byte what the
// reflective codec writes; any other form of them goes to the reflective
// decoder.
//
// # Calls and pushes
//
// A Client may have any number of requests in flight from any number of
// goroutines; each carries an id and its answer comes back with it, so
// answers may arrive in any order. The Server runs each request in its own
// goroutine (at most ServerConfig.MaxInflightPerConn at once per
// connection), except the kinds of ServerConfig.Inline (see below). The
// server pushes to a client with Peer.Push and waits for the
// acknowledgement; the client handles pushes one at a time in the order
// they came, which memory synchronisation relies on.
//
// A call on the call lane (below) that gives up, its context ended or its
// time run out, tells the server with a KindCancel frame naming its id,
// sent after the request on the same lane, and only if the lane has room
// at once. The server then ends the context of that request's handler,
// whether it runs or waits for a slot (it still runs then, its context
// ended, and its answer, owed, is dropped by the client); requests
// answered inline, and those on the connection, are not told. A
// cancellation names only calls of the peer that sends it.
//
// # The call lane: a round trip with one wake-up per side
//
// A round trip between two processes that block in the kernel costs two
// thread wake-ups, one per side, and on small virtual machines a wake-up
// costs as much as all the rest, or far more when it crosses to another
// virtual CPU (a C ping-pong over such a socket is nearly all waking up;
// the README gives the figures). A Go program that reads its
// socket through the runtime's network poller pays more: the poller's
// thread wakes, finds the goroutine waiting and hands it to a thread that
// can run it, waking another one; a reader goroutine that receives an
// answer hands it to the goroutine that waits for it; a server's reader
// hands each request to a handler goroutine. Each hand-off is a wake-up
// on the critical path: measured, they made a round trip several times
// the C floor, whether or not the reader polled first.
//
// So once a peer is admitted (its hello succeeded, or at once without
// ServerConfig.HelloKind), the server makes a socket pair, the call lane,
// and hands one end to the client with its first answer (a KindChannel
// frame). From then on requests and their answers travel on the lane,
// which both ends use with blocking system calls on the goroutine's own
// thread, outside the poller (see sock.Blocking):
//
//   - the calling goroutine that is the only one waiting receives its own
//     answer: it sends, then blocks in the kernel until the answer wakes
//     its thread. When several wait, the first reads for all of them and
//     hands each answer to its caller; when its own comes it hands the
//     reading to the next (leader and followers). A caller's cancellation
//     reaches the reader through an eventfd it polls beside the socket
//     (a call that cannot be cancelled skips the poll and waits in the
//     receive alone, its deadline kept by the socket's receive timeout,
//     unless others wait behind it as it begins to receive: a caller
//     whose deadline passes first waits, 100 ms at most, until the reader
//     has handed over what it took off the socket, which the reader marks
//     before it leaves the socket's queue unless it waits in the receive
//     alone; a call that began to wait while a receive alone was under
//     way may give up on an answer that receive took in time, if the
//     reader's thread does not run between the kernel's receive and its
//     return). With others waiting, the reader first takes what is
//     queued without waiting, and polls when that finds no message (or
//     once its call's deadline passed or its context ended: the poll is
//     what sees those).
//   - the server reads each peer's lane on a goroutine blocked in a receive,
//     which answers the inline kinds itself, from the thread the request
//     woke. Other kinds go to goroutines as before.
//
// The connection stays open beside the lane and carries what must never
// wait behind a call: the server's pushes and their acknowledgements
// (a secondary answers memory syncs even while idle, and a handler may
// push to its own peer while its request waits), the reason a server
// gives when it closes the connection, and everything before admission.
// Its reader sleeps in the poller and notices a dead peer at once. A
// peer's socket outlives its process when a child it forked without exec
// holds it: where the kernel gives a pidfd of the peer (Linux 6.5 on),
// the client and, once a peer is admitted, the server also wait in the
// poller for that process's exit, and end the connection then
// (Client.ServerExited says which end it was).
// Strangers never get a lane nor any descriptor.
//
// A round trip on the lane makes one sendto and one recvfrom per side,
// plus one ppoll on the client (the eventfd) when the call can be
// cancelled or others wait behind its reader (then a receive that finds
// nothing queued comes first), and no other system call
// or wake-up: the C floor's shape
// and calls. (A frame with descriptors goes after a one-byte notice, and
// is received with recvmsg; see sock.Blocking for descriptors that come
// without a notice.) The price is a thread per
// goroutine blocked on a lane: one per admitted peer in the server, one
// per waiting caller's reader in the client. A frame that finds no room
// in the peer's queue does not cost a thread: the frames that wait for
// room on one lane wait their turn parked, and only the first waits in
// the kernel, so a peer that stops reading holds at most one of the
// server's threads however many answers it leaves waiting. It is dropped
// once it has taken no frame for ServerConfig.WriteTimeout.
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
// checked as frames arrive, on the connection and on the lane alike,
// before any handler runs. A connection over a cap is closed and a
// request over a descriptor limit refused, both with ErrLimit as the
// reason; Server.Stats counts each limit that tripped, and the server
// logs it (at most once a second per limit).
//
// Descriptors the server refuses are dropped (sock.Drop: a socket is
// reset first, so that its close does not wait on a linger its sender
// set). A server that takes none at all (MaxFilesPerMessage negative)
// should listen with ListenNoFiles: the kernel then refuses them at the
// sender, on the connections and the lanes, and a client's call that
// carries some fails with ErrFilesRefused, its connection whole. Closing
// a descriptor can wait on whoever sent it in a way no drop can prevent (a
// file on a FUSE mount the sender serves), so only refusal keeps a
// server's threads, and its Close, from waiting on its peers. Where the
// kernel cannot refuse them, a server's call lanes receive every
// descriptor a peer sends, announced or not (sock.Blocking's
// ReceiveAllRights), so that none is closed inside the receive.
//
// Every wait has the caller's context as its bound, and none outlives the
// connection: when it ends, every pending and later call fails at once with
// ErrPeerGone. Errors that handlers return travel as a code and a message;
// a code registered with RegisterError comes back as an error that matches
// the same sentinel, so errors.Is works across processes.
package ipc
