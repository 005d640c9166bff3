//! Arbitrary bytes as an engine KV batch and as an event-plane payload: the decoders
//! must return errors or events, never panic, and the pipeline must accept whatever
//! the decoder produces.
#![no_main]

use eventplane::kv::{EngineDecoder, Pipeline, WorkerId, decode_router_events};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let block_size = usize::from(data.first().copied().unwrap_or(1) % 32) + 1;
    let mut decoder = EngineDecoder::new(WorkerId(1), block_size);
    if let Ok(events) = decoder.decode_batch(data) {
        let mut pipeline = Pipeline::default();
        let mut out = Vec::new();
        for ev in events {
            pipeline.push(ev, &mut out);
        }
        pipeline.flush(&mut out);
    }
    let _ = decode_router_events(data);
});
