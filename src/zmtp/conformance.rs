//! ZMTP conformance notes: which parts of RFC 23 (ZMTP 3.0) and RFC 37 (ZMTP 3.1) we
//! implement, the choices where peers differ, and what the interop tests prove.
//!
//! This module holds documentation only.
//!
//! # Greeting (RFC 23 §2.3)
//! - We send all 64 bytes at once: `FF`, 8 padding bytes (`00…01`), `7F`, version 3.1,
//!   `NULL`, as-server 0, 31 zero bytes. We never wait for the peer's greeting before
//!   sending ours (libzmq sends 10 bytes, waits, 1 byte, waits, then 53).
//! - The peer's greeting is validated byte by byte and rejected at the first bad one:
//!   byte 0 must be `FF`, byte 9 must have bit 0 set, major ≥ 3, mechanism `NULL`.
//!   Padding bytes 1–8 are not checked.
//!
//! # Frames and commands (RFC 23 §2.4–2.5)
//! - Short sizes up to 255, long (8-byte big-endian) above. Sizes are checked against
//!   [`Config`](super::Config) limits from the header alone, before any body byte is
//!   buffered.
//! - MORE on a command, or a command inside a multipart message, is a protocol error.
//!   Reserved flag bits are ignored unless `strict` is set (as libzmq ignores them).
//! - READY carries exactly `Socket-Type`; property names are matched
//!   case-insensitively; a missing `Socket-Type` is accepted (libzmq does); a present
//!   one must be PUB/XPUB for our SUB and SUB/XSUB for our PUB.
//! - During the handshake, ERROR is fatal with its reason surfaced, and any other
//!   command or a message is a protocol error. After it, unknown commands are ignored
//!   and counted, ERROR is fatal, a second READY is a protocol error.
//!
//! # Subscriptions (RFC 29, RFC 37 §2.7)
//! - To ZMTP 3.1 peers we send `SUBSCRIBE` / `CANCEL` commands; to 3.0 peers the
//!   message forms `01 prefix` / `00 prefix`, because zeromq-rs advertises 3.0 and
//!   closes the connection on any command but READY. As a publisher we accept both
//!   forms from anyone.
//! - Subscriptions are reference-counted locally: only 0→1 and 1→0 go on the wire.
//! - A SUB filters locally as well: messages that were in flight when a CANCEL was
//!   sent, or that a publisher over-delivers, never reach the application.
//!
//! # Heartbeats (RFC 37 §2.8)
//! - A PING is always answered with a PONG carrying its context, in every version
//!   (libzmq pings 3.0 peers too).
//! - We send PINGs only to 3.1 peers, with a TTL of at most 655 deciseconds (libzmq
//!   wraps larger values into seconds, libzmq#4226).
//! - Any received byte counts as liveness, so one large frame in flight never trips the
//!   timeout; a PING's TTL from the peer is honoured as a receive deadline.
//!
//! # Interop, as tested (`tests/zmtp_interop_*`)
//! - libzmq 4.3.4 (Debian `python3-zmq`): PUB → our SUB and our PUB → SUB, multipart,
//!   prefix filtering, HEARTBEAT_IVL with a 300 ms timeout during 1.5 s of silence, a
//!   PUB killed and restarted on the same port.
//! - zeromq 0.7 (3.0): both directions; our SUB subscribes with messages and sends no
//!   PING even with heartbeats configured.
//! - Observed: a libzmq 4.3.4 SUB silently loses messages that arrive before its own
//!   side of the handshake is complete (a raw stream that writes greeting, READY and
//!   data in one go hangs a libzmq SUB). A conforming PUB never does this, because it
//!   sends nothing before a subscription arrives; our `PubSocket` sends only to peers
//!   whose subscription matched.
