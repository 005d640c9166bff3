//! Golden tests against what a live Dynamo 1.6.1 worker wrote
//! (`tests/fixtures/dynamo-1.6.1-capture.json`, copied from the shared fixtures): the
//! exact event-plane frames for the engine batches in `engine_script`.
//!
//! - every captured frame parses under `Layout::Dynamo` and its payload decodes to the
//!   router events the capture lists;
//! - our encoder reproduces the captured envelope and payload byte for byte (with the
//!   captured `published_at`; with our own clock only those 8 bytes differ);
//! - our worker pipeline, fed the same engine batches, emits the same router events.
#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic,
    missing_docs
)]

use bytes::Bytes;
use eventplane::kv::{RouterEvent, WorkerId, engine::EngineDecoder, pipeline::Pipeline};
use eventplane::wire::{Dialect, Layout, WireError, encode_dynamo_frame, parse_dynamo_frame};
use eventplane::zmtp::Message;
use serde_json::Value;

mod support;

const PUBLISHER_ID: u64 = 3_390_985_166_245_404;

fn capture() -> Value {
    support::dynamo_capture()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn frames(capture: &Value) -> Vec<Message> {
    capture["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            Message::from_parts(
                m.as_array()
                    .unwrap()
                    .iter()
                    .map(|f| Bytes::from(unhex(f.as_str().unwrap()))),
            )
        })
        .collect()
}

/// The router events the capture's `decoded` section lists for one frame, built from
/// the JSON by hand (not by our decoder).
fn expected_events(decoded: &Value) -> Vec<RouterEvent> {
    support::dynamo_decoded_events(decoded)
}

#[test]
fn every_captured_frame_decodes_to_the_listed_events() {
    let capture = capture();
    let frames = frames(&capture);
    assert_eq!(frames.len(), 5);
    for (i, (message, decoded)) in frames
        .iter()
        .zip(capture["decoded"].as_array().unwrap())
        .enumerate()
    {
        let framed = Layout::Dynamo.parse(Some(b"kv-events"), message).unwrap();
        assert_eq!(framed.publisher_id, Some(PUBLISHER_ID));
        // Consecutive sequences (this capture left out the worker's first message, 0).
        assert_eq!(framed.sequence, Some(i as u64 + 1));
        let events = Dialect::Dynamo
            .decode_router_events(&framed.payload.unwrap())
            .unwrap();
        assert_eq!(events, expected_events(decoded), "frame {i}");
    }
}

#[test]
fn our_encoder_reproduces_the_captured_bytes() {
    let capture = capture();
    for (i, (message, decoded)) in frames(&capture)
        .iter()
        .zip(capture["decoded"].as_array().unwrap())
        .enumerate()
    {
        let captured = message.get(3).unwrap();
        let envelope = parse_dynamo_frame(captured).unwrap();
        let events = expected_events(decoded);
        let payload = Dialect::Dynamo.encode_router_events(&events).unwrap();
        assert_eq!(payload, envelope.payload, "payload of frame {i}");
        let mut frame = Vec::new();
        encode_dynamo_frame(
            "kv-events",
            PUBLISHER_ID,
            i as u64 + 1,
            envelope.published_at.unwrap(),
            &payload,
            &mut frame,
        );
        assert_eq!(frame, captured, "frame {i}, with the captured published_at");

        // With our own clock: the same message apart from published_at's 8 bytes.
        let ours = Dialect::Dynamo.encode(
            &Bytes::from_static(b"kv-events"),
            PUBLISHER_ID,
            i as u64 + 1,
            Bytes::from(payload),
        );
        assert!(
            ours.parts().take(3).eq(message.parts().take(3)),
            "frames 0-2 of {i}"
        );
        let (a, b) = (ours.get(3).unwrap(), captured);
        // The unit Dynamo uses (milliseconds since the epoch, as in the capture) and
        // our clock's now: not seconds, not microseconds, not a constant.
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let stamped = parse_dynamo_frame(a).unwrap().published_at.unwrap();
        assert!(
            stamped.abs_diff(now_ms) < 60_000,
            "frame {i}: published_at {stamped} is not near now ({now_ms} ms)"
        );
        let captured_at = envelope.published_at.unwrap();
        assert!(
            (1_700_000_000_000..4_000_000_000_000).contains(&captured_at),
            "the capture's published_at {captured_at} is in milliseconds"
        );
        assert_eq!(a.len(), b.len());
        let differing: Vec<usize> = (0..a.len()).filter(|&j| a[j] != b[j]).collect();
        let at = b.windows(12).position(|w| w == b"published_at").unwrap();
        // 12 name bytes, then 0xcf and the u64.
        assert!(
            differing.iter().all(|&j| j > at + 12 && j <= at + 12 + 8),
            "frame {i}: bytes {differing:?} differ outside published_at"
        );
    }
}

#[test]
fn a_frame_that_lies_about_its_identity_is_refused() {
    let capture = capture();
    let message = &frames(&capture)[0];
    let mut parts = message.clone().into_parts().collect::<Vec<_>>();
    parts[2] = Bytes::copy_from_slice(&2u64.to_be_bytes());
    let lying = Message::from_parts(parts);
    assert_eq!(
        Layout::Dynamo.parse(None, &lying).unwrap_err(),
        WireError::Identity("sequence")
    );
    // Our own layout reads the same frames without the envelope checks.
    let framed = Layout::TopicPublisherSeq.parse(None, message).unwrap();
    assert_eq!(framed.publisher_id, Some(PUBLISHER_ID));
}

/// The engine batches in `engine_script`, as a vLLM ≤ 0.23 engine would send them.
fn engine_batches(capture: &Value) -> Vec<Vec<u8>> {
    capture["engine_script"]
        .as_array()
        .unwrap()
        .iter()
        .map(|events| {
            let batch = serde_json::json!([1_700_000_000.5, events, 0]);
            rmp_serde::to_vec(&batch).unwrap()
        })
        .collect()
}

#[test]
fn our_worker_pipeline_emits_what_dynamo_emitted() {
    let capture = capture();
    // Worker 77, block size 4: what the captured Dynamo worker ran with.
    let mut decoder = EngineDecoder::new(WorkerId(77), 4).unwrap();
    let mut pipeline = Pipeline::default();
    let mut ours = Vec::new();
    for batch in engine_batches(&capture) {
        let mut out = Vec::new();
        for event in decoder.decode_batch(&batch).unwrap() {
            pipeline.push(event, &mut out);
        }
        pipeline.flush(&mut out);
        ours.push(out);
    }
    let theirs: Vec<Vec<RouterEvent>> = capture["decoded"]
        .as_array()
        .unwrap()
        .iter()
        .map(expected_events)
        .collect();
    assert_eq!(ours.len(), theirs.len());
    // Event ids are each side's own dense counter (Dynamo's started at 2 in this
    // capture, ours at 1): equal up to that offset, everything else exactly equal.
    let offset = theirs[0][0].event.id - ours[0][0].event.id;
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        let shifted: Vec<RouterEvent> = a
            .iter()
            .cloned()
            .map(|mut e| {
                e.event.id += offset;
                e
            })
            .collect();
        assert_eq!(&shifted, b, "batch {i}");
    }
}
