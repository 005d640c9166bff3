//! Dynamo's request plane, as a worker's KV query endpoint and a router's call-home
//! listener read it. The first byte picks what the rest is read as:
//! - 0: request frames, as they arrive (whole, then byte by byte): nothing may panic;
//!   a frame that decodes re-encodes to the bytes it took, and arriving in pieces
//!   changes nothing.
//! - 1: two-part messages, likewise.
//! - 2: a control header and a KV query body in both codecs: a query that decodes
//!   survives its own encoder.
//! - 3: an answer body in both codecs: an answer that decodes survives its own
//!   encoder in that codec.
#![no_main]

use bytes::BytesMut;
use eventplane::kv::dynamo_recovery::{
    AnswerBody, Codec, Control, KvQuery, RequestLimits, decode_request, decode_two_part,
    encode_request, encode_two_part,
};
use libfuzzer_sys::fuzz_target;

/// Small bounds, so that the fuzzer reaches them.
fn limits() -> RequestLimits {
    let mut l = RequestLimits::default();
    l.path = 64;
    l.headers = 256;
    l.payload = 4096;
    l
}

fn requests(rest: &[u8]) {
    let whole = {
        let mut buf = BytesMut::from(rest);
        let mut out = Vec::new();
        while let Ok(Some(frame)) = decode_request(&mut buf, limits()) {
            let again = encode_request(&frame.path, &frame.headers, &frame.payload)
                .expect("a decoded frame encodes");
            out.push(again);
        }
        out
    };
    let mut consumed = 0;
    for again in &whole {
        assert_eq!(&rest[consumed..consumed + again.len()], &again[..]);
        consumed += again.len();
    }
    // Byte by byte: the same frames.
    let mut buf = BytesMut::new();
    let mut pieces = Vec::new();
    for b in rest {
        buf.extend_from_slice(&[*b]);
        match decode_request(&mut buf, limits()) {
            Ok(Some(frame)) => pieces.push(
                encode_request(&frame.path, &frame.headers, &frame.payload).expect("encodes"),
            ),
            Ok(None) => {}
            Err(_) => break,
        }
    }
    // The canary (tools/fuzz.sh --canary): a decoder that loses a request fed byte
    // by byte. The oracle must catch it.
    #[cfg(fuzz_canary)]
    if pieces.len() > 1 {
        pieces.pop();
    }
    assert_eq!(pieces, whole);
}

fn two_parts(rest: &[u8]) {
    let mut buf = BytesMut::from(rest);
    let mut consumed = 0;
    while let Ok(Some(m)) = decode_two_part(&mut buf, 256, 4096) {
        let again = encode_two_part(&m.header, &m.body);
        // The checksum field is not kept: compare the rest.
        let took = &rest[consumed..consumed + again.len()];
        assert_eq!(&took[..16], &again[..16]);
        assert_eq!(&took[24..], &again[24..]);
        consumed += again.len();
    }
}

fn queries(rest: &[u8]) {
    if let Ok(control) = Control::decode(rest) {
        let again = Control::decode(&control.encode()).expect("our control decodes");
        assert_eq!(again, control);
    }
    for codec in [Codec::Msgpack, Codec::Json] {
        if let Ok(query) = KvQuery::decode(rest, codec) {
            let bytes = query.encode(codec).expect("a decoded query encodes");
            assert_eq!(KvQuery::decode(&bytes, codec).expect("ours decodes"), query);
        }
    }
}

fn answers(rest: &[u8]) {
    for codec in [Codec::Msgpack, Codec::Json] {
        if let Ok(answer) = AnswerBody::decode(rest, codec) {
            let bytes = answer.encode(codec).expect("a decoded answer encodes");
            assert_eq!(
                AnswerBody::decode(&bytes, codec).expect("ours decodes"),
                answer
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 4 {
        0 => requests(rest),
        1 => two_parts(rest),
        2 => queries(rest),
        _ => answers(rest),
    }
});
