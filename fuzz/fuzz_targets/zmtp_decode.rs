//! Arbitrary bytes into the frame decoder, the command parser and both session roles,
//! delivered in chunks whose size the input picks. Nothing may panic, and nothing may
//! be buffered beyond the configured limits.
#![no_main]

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use eventplane::zmtp::codec::{Command, FrameDecoder, FrameLimits};
use eventplane::zmtp::{Config, Session, SocketType};
use libfuzzer_sys::fuzz_target;

const HANDSHAKE: &[u8] = b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03\x01NULL\
\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\
\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\
\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x04\x06\x05READY";

fuzz_target!(|data: &[u8]| {
    let Some((&control, rest)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(control & 0x3f) + 1;
    let strict = control & 0x40 != 0;
    let skip_handshake = control & 0x80 != 0;

    let _ = Command::parse(Bytes::copy_from_slice(rest));

    let limits = FrameLimits {
        max_frame_size: 4096,
        max_message_size: 8192,
        max_message_parts: 8,
        max_command_size: 512,
        strict,
    };
    let mut decoder = FrameDecoder::new(limits);
    let mut buf = BytesMut::new();
    for piece in rest.chunks(chunk) {
        buf.extend_from_slice(piece);
        loop {
            match decoder.decode(&mut buf) {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => return,
            }
        }
        assert!(buf.len() <= 4096 + 9 + chunk);
    }

    let config = Config::builder()
        .max_frame_size(4096)
        .max_message_size(8192)
        .max_message_parts(8)
        .max_metadata_size(512)
        .max_subscriptions(16)
        .max_subscription_size(64)
        .heartbeat_interval(Some(Duration::from_secs(1)))
        .strict(strict)
        .build()
        .unwrap();
    for role in [SocketType::Sub, SocketType::Pub] {
        let mut now = Instant::now();
        let mut session = Session::new(role, &config, now);
        session.subscribe(Bytes::from_static(b"t"));
        if skip_handshake {
            session.handle_bytes(now, HANDSHAKE);
        }
        for piece in rest.chunks(chunk) {
            session.handle_bytes(now, piece);
            while let Some(_out) = session.poll_transmit() {}
            loop {
                match session.poll_event() {
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(_) => break,
                }
            }
            now += Duration::from_millis(700);
            let _ = session.handle_timeout(now);
            if session.is_failed() {
                break;
            }
        }
    }
});
