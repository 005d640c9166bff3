//! A loopback writer of a pre-encoded ZMTP stream, shared by the receive benches.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use eventplane::zmtp::codec::encode_message;
use eventplane::zmtp::{Config, Event, Message, Session, SocketType};

/// Every message's first frame.
pub(crate) const TOPIC: &[u8; 4] = b"kvev";

/// A loopback "publisher": it runs the handshake with our sans-IO `Session` and, like
/// any PUB, waits for the subscription (libzmq 4.3 discards messages that arrive
/// before its side of the handshake is done), then writes a pre-encoded buffer of
/// messages as fast as the socket takes it.
pub(crate) struct Blaster {
    listener: TcpListener,
    /// `tcp://127.0.0.1:port`.
    pub(crate) endpoint: String,
    /// Whole messages, about 1 MiB.
    chunk: Vec<u8>,
    /// Bytes per message on the wire.
    pub(crate) msg_len: usize,
}

impl Blaster {
    pub(crate) fn new(payload: usize) -> Blaster {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
        let mut one = BytesMut::new();
        let msg = Message::from_parts([
            TOPIC.to_vec(),
            7u64.to_be_bytes().to_vec(),
            vec![0xab; payload],
        ]);
        encode_message(&msg, &mut one);
        let msg_len = one.len();
        let per_chunk = (1 << 20) / msg_len + 1;
        let mut chunk = Vec::with_capacity(per_chunk * msg_len);
        for _ in 0..per_chunk {
            chunk.extend_from_slice(&one);
        }
        Blaster {
            listener,
            endpoint,
            chunk,
            msg_len,
        }
    }

    /// Accepts one connection and writes `count` messages on it.
    pub(crate) fn serve(&self, count: u64) -> JoinHandle<()> {
        let listener = self.listener.try_clone().unwrap();
        let chunk = self.chunk.clone();
        let msg_len = self.msg_len;
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_nodelay(true).unwrap();
            s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
            handshake_until_subscribed(&mut s);
            let mut left = count as usize * msg_len;
            while left > 0 {
                let n = left.min(chunk.len());
                if s.write_all(&chunk[..n]).is_err() {
                    return;
                }
                left -= n;
            }
            // Drain whatever the subscriber sent until it hangs up.
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut sink = [0u8; 4096];
            while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
        })
    }
}

fn handshake_until_subscribed(s: &mut TcpStream) {
    let mut session = Session::new(SocketType::Pub, &Config::default(), Instant::now());
    let mut buf = [0u8; 4096];
    loop {
        let mut subscribed = false;
        while let Some(event) = session.poll_event().unwrap() {
            subscribed |= matches!(event, Event::Subscribe(_));
        }
        while let Some(out) = session.poll_transmit() {
            s.write_all(&out).unwrap();
        }
        if subscribed {
            return;
        }
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "subscriber left during the handshake");
        session.handle_bytes(Instant::now(), &buf[..n]);
    }
}
