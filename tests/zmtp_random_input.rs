//! Random bytes into both session roles (a quick, always-on cousin of the cargo-fuzz
//! target in `fuzz/`): never a panic, and buffered input stays within the bounds.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use eventplane::zmtp::{Config, Session, SocketType};
use support::cases::cases;

fn handshake() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g.extend_from_slice(b"\x04\x06\x05READY");
    g
}

#[test]
fn sessions_survive_random_input() {
    cases(2000, |rng| {
        let len = rng.range(0..4096);
        let data = rng.bytes(len);
        let chunk = rng.range(1..300);
        let after_handshake = rng.bool();
        let pub_role = rng.bool();
        let config = Config::builder()
            .max_frame_size(1024)
            .max_message_size(2048)
            .max_metadata_size(256)
            .heartbeat_interval(Some(Duration::from_secs(1)))
            .build()
            .unwrap();
        let role = if pub_role {
            SocketType::Pub
        } else {
            SocketType::Sub
        };
        let mut now = Instant::now();
        let mut s = Session::new(role, &config, now);
        s.subscribe(Bytes::from_static(b""));
        if after_handshake {
            s.handle_bytes(now, &handshake());
        }
        for piece in data.chunks(chunk) {
            s.handle_bytes(now, piece);
            while s.poll_transmit().is_some() {}
            while let Ok(Some(_)) = s.poll_event() {}
            assert!(s.input_buffer().len() <= 2048 + 9 + chunk);
            now += Duration::from_millis(300);
            let _ = s.handle_timeout(now);
            if s.is_failed() {
                break;
            }
        }
    });
}
