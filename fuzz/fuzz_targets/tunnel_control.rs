//! Tunnel control frames from hostile bytes, with oracles. The input is split at
//! arbitrary points and fed to a `ControlDecoder` (limit 4 KiB) and, frame by frame,
//! to a broker and a router session, each in every state it can reach:
//! - nothing panics; the decoder never holds more than the limit plus its header;
//! - every frame that decodes re-encodes to a frame that decodes to the same value;
//! - the sessions' outgoing queues stay within `MAX_QUEUED_CONTROL`.
#![no_main]

use std::time::{Duration, Instant};

use eventplane::tunnel::protocol::{
    BrokerSession, Control, ControlDecoder, Hello, Limits, MAX_QUEUED_CONTROL, RouterSession,
    Welcome,
};
use libfuzzer_sys::fuzz_target;

const LIMIT: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let now = Instant::now();
    let mut decoder = ControlDecoder::new(LIMIT);
    let mut broker = BrokerSession::new(Hello::new("b", vec!["ns".into()]), now);
    let _ = broker.poll_transmit();
    // Half the runs start the broker welcomed, so its command handling is reached.
    if split & 1 == 1 {
        broker.handle(Control::Welcome(Welcome::new(1, 1, Limits::default())), now);
    }
    let mut router = RouterSession::new(1, Limits::default(), now);
    if split & 2 == 2 {
        router.handle(Control::Hello(Hello::new("b", vec![])), now);
    }
    let chunk = usize::from(split >> 2).max(1);
    let mut t = now;
    for piece in rest.chunks(chunk) {
        let mut input = piece;
        loop {
            match decoder.decode(&mut input) {
                Ok(Some(frame)) => {
                    let mut wire = Vec::new();
                    frame.encode(&mut wire);
                    let mut again = ControlDecoder::new(usize::MAX);
                    // The canary (tools/fuzz.sh --canary): an encoder that loses a
                    // frame's last byte. The round-trip oracle must catch it.
                    #[cfg(fuzz_canary)]
                    wire.pop();
                    let mut w = &wire[..];
                    assert_eq!(again.decode(&mut w).ok().flatten(), Some(frame.clone()));
                    t += Duration::from_millis(1);
                    broker.handle(frame.clone(), t);
                    router.handle(frame, t);
                }
                Ok(None) => break,
                Err(_) => return,
            }
            assert!(decoder.buffered() <= LIMIT + 4);
        }
    }
    let queued = std::iter::from_fn(|| broker.poll_transmit()).count();
    assert!(queued <= MAX_QUEUED_CONTROL);
    let queued = std::iter::from_fn(|| router.poll_transmit()).count();
    assert!(queued <= MAX_QUEUED_CONTROL);
});
