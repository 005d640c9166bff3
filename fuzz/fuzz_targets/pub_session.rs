//! A publisher's session (what `PubSocket` runs per connection) fed arbitrary
//! subscriber bytes after a valid greeting and READY, split at points the input
//! chooses. Checked on every step:
//! - nothing panics;
//! - the input buffer never holds more than a frame a subscriber may send after the
//!   handshake (a message of the subscription limit + 1, a command of 512 bytes, plus
//!   a header) and one delivered piece;
//! - pending output stays within the handshake replies and one PONG;
//! - the subscriptions reported (Subscribe/Cancel events) never exceed
//!   `max_subscriptions`, never cancel what was not subscribed, and every prefix is
//!   within `max_subscription_size`;
//! - delivering the same bytes in one piece gives the same events and the same end
//!   state (failed or not) as the chosen split.
#![no_main]

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use eventplane::zmtp::{Config, Event, Session, SocketType};
use libfuzzer_sys::fuzz_target;

const MAX_SUBSCRIPTIONS: usize = 16;
const MAX_SUBSCRIPTION_SIZE: usize = 64;

/// A ZMTP 3.1 subscriber's greeting and READY.
fn hello() -> Vec<u8> {
    // Our own greeting is a SUB's: ZMTP 3.1, NULL, not as-server.
    let mut g = bytes::BytesMut::new();
    eventplane::zmtp::codec::encode_greeting(&mut g);
    let mut g = g.to_vec();
    g.extend_from_slice(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB");
    g
}

fn config() -> Config {
    Config::builder()
        .max_subscriptions(MAX_SUBSCRIPTIONS)
        .max_subscription_size(MAX_SUBSCRIPTION_SIZE)
        .heartbeat_interval(Some(Duration::from_secs(1)))
        .build()
        .unwrap()
}

/// What one run observed.
#[derive(Debug, PartialEq, Eq)]
struct Run {
    events: Vec<(bool, Bytes)>,
    failed: bool,
}

/// Feeds `pieces` to a fresh publisher session, checking the invariants after each.
fn run<'a>(pieces: impl Iterator<Item = &'a [u8]>) -> Run {
    let config = config();
    let mut now = Instant::now();
    let mut session = Session::new(SocketType::Pub, &config, now);
    session.handle_bytes(now, &hello());
    let mut events = Vec::new();
    let mut subscribed = BTreeSet::new();
    let mut step = |session: &mut Session, events: &mut Vec<(bool, Bytes)>| -> bool {
        loop {
            match session.poll_event() {
                Ok(Some(Event::Subscribe(p))) => {
                    assert!(p.len() <= MAX_SUBSCRIPTION_SIZE);
                    assert!(subscribed.insert(p.clone()), "subscribed twice: {p:?}");
                    assert!(subscribed.len() <= MAX_SUBSCRIPTIONS);
                    events.push((true, p));
                }
                Ok(Some(Event::Cancel(p))) => {
                    assert!(subscribed.remove(&p), "cancelled unknown {p:?}");
                    events.push((false, p));
                }
                Ok(Some(_)) => {}
                Ok(None) => return true,
                Err(_) => return false,
            }
        }
    };
    let mut failed = !step(&mut session, &mut events);
    for piece in pieces {
        if failed {
            break;
        }
        session.handle_bytes(now, piece);
        failed = !step(&mut session, &mut events);
        // One incomplete frame (a command of at most 512 bytes, a message of at most
        // the subscription limit + 1) and its header, besides the piece just delivered.
        assert!(
            session.input_buffer().len() <= 512 + 9 + piece.len(),
            "{} buffered",
            session.input_buffer().len()
        );
        // Greeting + READY + at most one PONG (and one PING of ours).
        assert!(session.pending_output() <= 64 + 64 + 32 + 32);
        now += Duration::from_millis(10);
        if session.handle_timeout(now).is_err() {
            failed = true;
        }
        while session.poll_transmit().is_some() {}
    }
    Run { events, failed }
}

fuzz_target!(|data: &[u8]| {
    // [n cuts][n × u16 cut positions][subscriber bytes]
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 16);
    if rest.len() < 2 * n {
        return;
    }
    let (cut_bytes, stream) = rest.split_at(2 * n);
    let mut cuts: Vec<usize> = cut_bytes
        .chunks_exact(2)
        .map(|c| usize::from(u16::from_be_bytes([c[0], c[1]])) % (stream.len() + 1))
        .collect();
    cuts.push(0);
    cuts.push(stream.len());
    cuts.sort_unstable();
    cuts.dedup();
    let pieces = cuts.windows(2).map(|w| &stream[w[0]..w[1]]);
    #[allow(unused_mut)]
    let mut split = run(pieces);
    // The canary (tools/fuzz.sh --canary): a session that loses an event when its
    // input comes in pieces. The split-invariance oracle must catch it.
    #[cfg(fuzz_canary)]
    if cuts.len() > 3 && split.events.len() > 1 {
        split.events.pop();
    }
    let whole = run(std::iter::once(stream));
    // Timeouts are driven per piece; with heartbeats every second and 10 ms steps no
    // timer fires in either run, so both must agree exactly.
    assert_eq!(split, whole);
});
