//! A subscriber's session and the frame decoder fed arbitrary publisher bytes, split at
//! points the input chooses. The first byte picks the mode:
//! - bit 0: prefix a valid greeting and READY, so the fuzzer works on what follows the
//!   handshake (without it, it fuzzes the greeting itself);
//! - bit 1: strict mode (reserved flag bits are errors);
//! - bit 2: instead of raw bytes, build messages from the input, encode them, and check
//!   that the session hands back exactly those messages (decode(encode(x)) == x);
//! - bit 3: also send those messages from our PUB session to our SUB session through a
//!   `zmtp::Pair`, and check that they all arrive, in order.
//!
//! The next byte gives a number of cuts (0–15), then two bytes per cut position; the
//! rest is the body. Checked on every run:
//! - nothing panics;
//! - after each piece, the session's input buffer holds at most one frame (header and
//!   body within `max_frame_size`) plus the piece just delivered, and its pending output
//!   stays within its handshake replies and one PONG;
//! - every delivered message is within the part and size limits;
//! - the chosen split, the whole input at once and one byte at a time give the same
//!   events and the same end (the same error, or none);
//! - the frame decoder alone gives the same frames or the same error for the chosen
//!   split and the whole input.
#![no_main]

use std::time::Instant;

use bytes::{Bytes, BytesMut};
use eventplane::zmtp::codec::{Decoded, FrameDecoder, FrameLimits, encode_message};
use eventplane::zmtp::{Config, Error, Event, Message, Pair, Session, Side, SocketType};
use libfuzzer_sys::fuzz_target;

// Small limits, so the fuzzer's inputs (4 KiB by default) cross them and the
// buffer bounds below are exercised, not vacuous.
const MAX_FRAME: usize = 256;
const MAX_MESSAGE: usize = 2048;
const MAX_PARTS: usize = 8;

/// A ZMTP 3.1 publisher's greeting and READY.
fn hello() -> Vec<u8> {
    let mut g = BytesMut::new();
    eventplane::zmtp::codec::encode_greeting(&mut g);
    let mut g = g.to_vec();
    g.extend_from_slice(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB");
    g
}

fn config(strict: bool) -> Config {
    Config::builder()
        .max_frame_size(MAX_FRAME)
        .max_message_size(MAX_MESSAGE)
        .max_message_parts(MAX_PARTS)
        .max_metadata_size(512)
        .strict(strict)
        .build()
        .unwrap()
}

/// What one run observed: its events, and how it ended.
#[derive(Debug, PartialEq, Eq)]
struct Run {
    events: Vec<Event>,
    error: Option<String>,
}

fn describe(e: &Error) -> String {
    format!("{e:?}")
}

/// Feeds `wire` to a fresh subscribed SUB session in the pieces `cuts` delimit,
/// checking the buffer and output bounds after every piece.
fn run_session(wire: &[u8], cuts: &[usize], strict: bool) -> Run {
    let now = Instant::now();
    let mut session = Session::new(SocketType::Sub, &config(strict), now);
    session.subscribe(Bytes::new());
    let mut events = Vec::new();
    let mut start = 0;
    for &end in cuts.iter().chain(std::iter::once(&wire.len())) {
        let end = end.clamp(start, wire.len());
        let piece = &wire[start..end];
        start = end;
        session.handle_bytes(now, piece);
        while let Some(out) = session.poll_transmit() {
            // Our greeting, READY and subscription, or one PONG.
            assert!(out.len() <= 512, "{} bytes of output at once", out.len());
        }
        loop {
            match session.poll_event() {
                Ok(Some(ev)) => {
                    if let Event::Message(m) = &ev {
                        assert!(m.len() <= MAX_PARTS);
                        assert!(m.byte_len() <= MAX_MESSAGE);
                    }
                    events.push(ev);
                }
                Ok(None) => break,
                Err(e) => {
                    return Run {
                        events,
                        error: Some(describe(&e)),
                    };
                }
            }
        }
        assert!(session.pending_output() <= 512);
        let held = session.input_buffer().len();
        assert!(
            held <= 9 + MAX_FRAME + piece.len(),
            "{held} bytes buffered after a piece of {}",
            piece.len()
        );
    }
    // The canary (tools/fuzz.sh --canary): a session that loses a message when its
    // input comes in pieces. The split-invariance oracle below must catch it.
    #[cfg(fuzz_canary)]
    if cuts.len() > 1 && events.len() > 1 {
        events.pop();
    }
    Run {
        events,
        error: None,
    }
}

/// The frame decoder alone: the frames it gives, and its error if any.
fn run_decoder(wire: &[u8], cuts: &[usize], strict: bool) -> (Vec<Decoded>, Option<String>) {
    let mut decoder = FrameDecoder::new(FrameLimits {
        max_frame_size: MAX_FRAME,
        max_message_size: MAX_MESSAGE,
        max_message_parts: MAX_PARTS,
        max_command_size: 512,
        strict,
    });
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut start = 0;
    for &end in cuts.iter().chain(std::iter::once(&wire.len())) {
        let end = end.clamp(start, wire.len());
        let piece = end - start;
        buf.extend_from_slice(&wire[start..end]);
        start = end;
        loop {
            match decoder.decode(&mut buf) {
                Ok(Some(d)) => out.push(d),
                Ok(None) => break,
                Err(e) => return (out, Some(format!("{e:?}"))),
            }
        }
        assert!(
            buf.len() <= 9 + MAX_FRAME + piece,
            "{} bytes buffered after a piece of {piece}",
            buf.len()
        );
    }
    (out, None)
}

/// Messages built from `body`: each starts with a byte giving its part count (1–8),
/// then per part a byte giving its length; the parts take bytes from the body.
fn messages(body: &[u8]) -> Vec<Message> {
    let mut out = Vec::new();
    let mut rest = body;
    while let Some((&head, tail)) = rest.split_first() {
        rest = tail;
        let parts = usize::from(head % MAX_PARTS as u8) + 1;
        let mut frames = Vec::new();
        for _ in 0..parts {
            let Some((&len, tail)) = rest.split_first() else {
                break;
            };
            let len = usize::from(len).min(tail.len());
            frames.push(Bytes::copy_from_slice(&tail[..len]));
            rest = &tail[len..];
        }
        if !frames.is_empty() {
            out.push(Message::from_parts(frames));
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&control, rest)) = data.split_first() else {
        return;
    };
    let (prefixed, strict, encoded) = (control & 1 != 0, control & 2 != 0, control & 4 != 0);
    let Some((&ncuts, rest)) = rest.split_first() else {
        return;
    };
    let ncuts = usize::from(ncuts & 15);
    if rest.len() < 2 * ncuts {
        return;
    }
    let (cut_bytes, body) = rest.split_at(2 * ncuts);
    let mut wire = if prefixed || encoded {
        hello()
    } else {
        Vec::new()
    };
    let expected = encoded.then(|| messages(body));
    match &expected {
        Some(msgs) => {
            let mut buf = BytesMut::new();
            for m in msgs {
                encode_message(m, &mut buf);
            }
            wire.extend_from_slice(&buf);
        }
        None => wire.extend_from_slice(body),
    }
    let mut cuts: Vec<usize> = cut_bytes
        .chunks(2)
        .map(|c| usize::from(u16::from_be_bytes([c[0], c[1]])) % (wire.len() + 1))
        .collect();
    cuts.sort_unstable();

    let chosen = run_session(&wire, &cuts, strict);
    let whole = run_session(&wire, &[], strict);
    assert_eq!(chosen, whole, "the split changed what the session saw");
    if wire.len() <= 4096 {
        let every: Vec<usize> = (1..wire.len()).collect();
        assert_eq!(
            run_session(&wire, &every, strict),
            whole,
            "byte-at-a-time changed what the session saw"
        );
    }
    if let Some(msgs) = expected {
        // Every message is within the limits by construction: all come back, in order.
        assert_eq!(whole.error, None);
        let got: Vec<&Message> = whole
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Message(m) => Some(m),
                _ => None,
            })
            .collect();
        assert_eq!(got, msgs.iter().collect::<Vec<_>>());
    }
    if control & 8 != 0 {
        let msgs = messages(body);
        assert_eq!(through_a_pair(&msgs, strict), msgs);
    }
    // The decoder alone, after the handshake bytes (it does not parse greetings).
    let frames = if prefixed || encoded {
        &wire[64..]
    } else {
        &wire[..]
    };
    let shifted: Vec<usize> = cuts
        .iter()
        .map(|c| c.saturating_sub(wire.len() - frames.len()))
        .collect();
    assert_eq!(
        run_decoder(frames, &shifted, strict),
        run_decoder(frames, &[], strict),
        "the split changed what the decoder gave"
    );
});

/// `msgs` sent by our PUB session to our SUB session (subscribed to everything), one
/// drive per message; what the SUB delivered.
fn through_a_pair(msgs: &[Message], strict: bool) -> Vec<Message> {
    let config = config(strict);
    let mut pair = Pair::new(&config, &config, Instant::now());
    pair.sub.subscribe(Bytes::new());
    pair.drive().expect("two of our sessions shake hands");
    for m in msgs {
        pair.publ.send_message(m);
        pair.drive().expect("a message within the limits crosses");
    }
    pair.take_events(Side::Sub)
        .into_iter()
        .filter_map(|e| match e {
            Event::Message(m) => Some(m),
            _ => None,
        })
        .collect()
}
