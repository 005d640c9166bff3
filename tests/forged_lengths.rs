//! Forged frame lengths never make us allocate what they claim. Resident memory cannot
//! show this (a reservation that is never touched is not resident), so this test
//! binary counts every allocation: its global allocator refuses to go more than a
//! few MiB past what was allocated when the attack started, and a refused allocation
//! aborts the process. One test in the binary, so nothing else allocates beside it.
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::alloc::System;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use cap::Cap;
use eventplane::zmtp::{Config, ProtocolError, SubSocket};
use support::{greeting, within};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

const MIB: usize = 1 << 20;

/// Held while a test runs under an allocation cap (the cap is process-wide).
static CAPPED: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A publisher that completes the handshake, then sends a long-frame header claiming
/// `size` bytes and never the body. With `hang_up`, it then closes its side (so the
/// reader sees the end of the stream right after the header); otherwise it keeps the
/// connection open until the client leaves.
async fn forger(size: u64, hang_up: bool) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut script = greeting(3, 1, b"NULL");
        script.extend_from_slice(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB");
        let mut header = BytesMut::new();
        header.put_u8(0x02);
        header.put_u64(size);
        script.extend_from_slice(&header);
        let _ = stream.write_all(&script).await;
        if hang_up {
            let _ = stream.shutdown().await;
        }
        let mut sink = [0u8; 1024];
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    });
    endpoint
}

#[tokio::test(flavor = "current_thread")]
// The guard serializes the process-wide allocation cap with the other test, which
// waits for it on its own thread: held across awaits on purpose.
#[allow(clippy::await_holding_lock)]
async fn forged_lengths_never_allocate_what_they_claim() {
    let config = Config::default(); // 8 MiB frames, 16 MiB messages
    // Warm up everything that allocates once (runtime, resolver, tracing callsites).
    let endpoint = forger(1 << 40, false).await;
    let mut sub = within(SubSocket::connect(&endpoint, config.clone()))
        .await
        .unwrap();
    sub.subscribe("").await.unwrap();
    let _ = within(sub.recv()).await;
    drop(sub);

    // From here, at most 4 MiB more may be allocated at any moment.
    let _capped = CAPPED.lock().unwrap_or_else(|p| p.into_inner());
    let base = ALLOCATOR.allocated();
    ALLOCATOR.set_limit(base + 4 * MIB).unwrap();
    // Claims past the limit are refused at the header.
    for size in [1u64 << 36, 1 << 63, u64::MAX, (8 << 20) + 1] {
        let endpoint = forger(size, false).await;
        let mut sub = within(SubSocket::connect(&endpoint, config.clone()))
            .await
            .unwrap();
        sub.subscribe("").await.unwrap();
        let err = within(sub.recv()).await.unwrap_err();
        assert!(
            matches!(err.protocol(), Some(ProtocolError::FrameTooLarge { size: s, .. }) if *s == size),
            "{err:?}"
        );
    }
    // Claims within the limit whose bodies never come: eight connections each
    // claiming a whole 8 MiB frame hold only what actually arrived (nothing).
    let mut subs = Vec::new();
    for _ in 0..8 {
        let endpoint = forger(8 << 20, false).await;
        let mut sub = within(SubSocket::connect(&endpoint, config.clone()))
            .await
            .unwrap();
        sub.subscribe("").await.unwrap();
        let waited = tokio::time::timeout(Duration::from_millis(200), sub.recv()).await;
        assert!(waited.is_err(), "the body never came: {waited:?}");
        subs.push(sub);
    }
    let held = ALLOCATOR.allocated().saturating_sub(base);
    // The same claim followed by the end of the stream: the error proves the header
    // was read (and acted on) under the limit, not merely sent.
    for _ in 0..4 {
        let endpoint = forger(8 << 20, true).await;
        let mut sub = within(SubSocket::connect(&endpoint, config.clone()))
            .await
            .unwrap();
        sub.subscribe("").await.unwrap();
        let err = within(sub.recv()).await.unwrap_err();
        assert!(err.is_io(), "{err:?}");
    }
    ALLOCATOR.set_limit(usize::MAX).unwrap();
    eprintln!(
        "figure: a SUB with eight connections each claiming an 8 MiB frame and never \
         sending it: {} KiB allocated (bound 4096 KiB)",
        held >> 10
    );
    assert!(held < 4 * MIB, "{held}");
}

/// Router-event payloads (ours and Dynamo's) whose containers claim far more elements
/// than they hold: refused before serde reserves for the claim. Each payload is a few
/// bytes; what decoding it may allocate at its peak is bounded by a small multiple of
/// that, not by the 1 MiB per vector serde would reserve.
#[test]
fn forged_router_event_lengths_reserve_nothing() {
    use eventplane::wire::Dialect;
    let forged: [&[u8]; 4] = [
        b"\xdd\xff\xff\xff\xff",
        b"\x91\x84\xa9worker_id\x01\xacstorage_tier\xa6device\xa5event\x83\xa8event_id\x01\xa7dp_rank\x00\xa4data\x81\xa6stored\x81\xa6blocks\xdd\x00\x10\x00\x00",
        b"\x91\xdd\x00\x0f\xff\xff",
        b"\xdc\xff\xff\xc0",
    ];
    for payload in forged {
        // Warm: anything a first call allocates once.
        let _ = Dialect::EventPlane.decode_router_events(payload);
        let _ = Dialect::Dynamo.decode_router_events(payload);
        // Anything past 64 KiB more than now aborts the test process.
        let _capped = CAPPED.lock().unwrap_or_else(|p| p.into_inner());
        ALLOCATOR
            .set_limit(ALLOCATOR.allocated() + 64 * 1024)
            .unwrap();
        let ours = Dialect::EventPlane.decode_router_events(payload).is_err();
        let dynamo = Dialect::Dynamo.decode_router_events(payload).is_err();
        ALLOCATOR.set_limit(usize::MAX).unwrap();
        assert!(ours && dynamo, "{payload:02x?} decoded");
    }
}
