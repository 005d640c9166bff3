//! Sans-IO wire tests: golden bytes, handshakes, version-dependent behaviour,
//! heartbeats with explicit time, and a property test over random splits.
#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic,
    missing_docs
)]

mod support;

use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use eventplane::zmtp::codec::{
    Command, Decoded, FrameDecoder, FrameLimits, encode_greeting, encode_message,
};
use eventplane::zmtp::{
    Config, Error, Event, Message, ProtocolError, Session, SocketType, TimeoutKind,
};
use support::cases::cases;
use support::greeting;

fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = BytesMut::new();
    body.put_u8(5);
    body.put_slice(b"READY");
    body.put_u8(11);
    body.put_slice(b"Socket-Type");
    body.put_u32(socket_type.len() as u32);
    body.put_slice(socket_type.as_bytes());
    let mut out = vec![0x04, body.len() as u8];
    out.extend_from_slice(&body);
    out
}

fn drain(s: &mut Session) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(b) = s.poll_transmit() {
        out.extend_from_slice(&b);
    }
    out
}

fn events(s: &mut Session) -> Result<Vec<Event>, Error> {
    let mut out = Vec::new();
    while let Some(e) = s.poll_event()? {
        out.push(e);
    }
    Ok(out)
}

/// A SUB session that completed its handshake with a peer of the given minor version.
fn ready_sub(config: &Config, minor: u8, now: Instant) -> Session {
    let mut s = Session::new(SocketType::Sub, config, now);
    s.handle_bytes(now, &greeting(3, minor, b"NULL"));
    s.handle_bytes(now, &ready("PUB"));
    let ev = events(&mut s).unwrap();
    assert!(matches!(ev.as_slice(), [Event::Ready(_)]), "{ev:?}");
    drain(&mut s);
    s
}

#[test]
fn golden_greeting() {
    let mut s = Session::new(SocketType::Sub, &Config::default(), Instant::now());
    let g = drain(&mut s);
    assert_eq!(g, greeting(3, 1, b"NULL"));
    let mut enc = BytesMut::new();
    encode_greeting(&mut enc);
    assert_eq!(&enc[..], &g[..]);
}

#[test]
fn golden_ready_after_greeting_only() {
    let now = Instant::now();
    let mut s = Session::new(SocketType::Sub, &Config::default(), now);
    drain(&mut s);
    // libzmq's staged greeting: 10 bytes, then 1, then 53. Nothing but our greeting
    // goes out until the whole peer greeting has arrived.
    let g = greeting(3, 1, b"NULL");
    s.handle_bytes(now, &g[..10]);
    assert!(events(&mut s).unwrap().is_empty());
    assert!(drain(&mut s).is_empty());
    s.handle_bytes(now, &g[10..11]);
    assert!(events(&mut s).unwrap().is_empty());
    assert!(drain(&mut s).is_empty());
    s.handle_bytes(now, &g[11..]);
    assert!(events(&mut s).unwrap().is_empty());
    let out = drain(&mut s);
    assert_eq!(
        out,
        b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB".to_vec()
    );
    assert_eq!(out, ready("SUB"));
}

#[test]
fn golden_subscribe_and_cancel_3_1() {
    let now = Instant::now();
    let mut s = ready_sub(&Config::default(), 1, now);
    s.subscribe(Bytes::from_static(b"kv"));
    assert_eq!(drain(&mut s), b"\x04\x0c\x09SUBSCRIBEkv");
    // Reference counted: a second subscribe sends nothing, the first unsubscribe too.
    s.subscribe(Bytes::from_static(b"kv"));
    assert!(drain(&mut s).is_empty());
    assert!(s.unsubscribe(b"kv"));
    assert!(drain(&mut s).is_empty());
    assert!(s.unsubscribe(b"kv"));
    assert_eq!(drain(&mut s), b"\x04\x09\x06CANCELkv");
    assert!(!s.unsubscribe(b"kv"));
}

#[test]
fn golden_subscribe_and_cancel_3_0() {
    let now = Instant::now();
    let mut s = ready_sub(&Config::default(), 0, now);
    s.subscribe(Bytes::from_static(b"kv"));
    assert_eq!(drain(&mut s), b"\x00\x03\x01kv");
    s.unsubscribe(b"kv");
    assert_eq!(drain(&mut s), b"\x00\x03\x00kv");
}

#[test]
fn subscriptions_made_before_handshake_follow_ready() {
    let now = Instant::now();
    let mut s = Session::new(SocketType::Sub, &Config::default(), now);
    s.subscribe(Bytes::from_static(b"a"));
    drain(&mut s);
    s.handle_bytes(now, &greeting(3, 1, b"NULL"));
    s.handle_bytes(now, &ready("PUB"));
    events(&mut s).unwrap();
    let mut expect = ready("SUB");
    expect.extend_from_slice(b"\x04\x0b\x09SUBSCRIBEa");
    assert_eq!(drain(&mut s), expect);
}

#[test]
fn golden_ping_pong_in_every_version() {
    for minor in [0, 1] {
        let now = Instant::now();
        let mut s = ready_sub(&Config::default(), minor, now);
        s.handle_bytes(now, b"\x04\x0a\x04PING\x00\x1ectx");
        assert!(events(&mut s).unwrap().is_empty());
        assert_eq!(drain(&mut s), b"\x04\x08\x04PONGctx");
        assert_eq!(s.stats().pings_received, 1);
    }
}

#[test]
fn pings_only_3_1_peers() {
    let config = Config::builder()
        .heartbeat_interval(Some(Duration::from_secs(1)))
        .heartbeat_ttl(Some(Duration::from_secs(3)))
        .build()
        .unwrap();
    let t0 = Instant::now();
    // ZMTP 3.0 (zeromq-rs closes on any command but READY): never a PING.
    let mut old = ready_sub(&config, 0, t0);
    assert_eq!(old.poll_timeout(), None);
    old.handle_timeout(t0 + Duration::from_secs(60)).unwrap();
    assert!(drain(&mut old).is_empty());
    // ZMTP 3.1: PING with TTL 30 ds after one interval.
    let mut new = ready_sub(&config, 1, t0);
    assert_eq!(new.poll_timeout(), Some(t0 + Duration::from_secs(1)));
    new.handle_timeout(t0 + Duration::from_secs(1)).unwrap();
    assert_eq!(drain(&mut new), b"\x04\x07\x04PING\x00\x1e");
    assert_eq!(new.stats().pings_sent, 1);
}

#[test]
fn heartbeat_timeout_without_reply_and_liveness_from_any_byte() {
    let config = Config::builder()
        .heartbeat_interval(Some(Duration::from_secs(1)))
        .heartbeat_timeout(Some(Duration::from_secs(2)))
        .build()
        .unwrap();
    let t0 = Instant::now();
    let mut s = ready_sub(&config, 1, t0);
    let t1 = t0 + Duration::from_secs(1);
    s.handle_timeout(t1).unwrap(); // PING out, deadline t1 + 2 s
    // Part of a large frame arriving counts as liveness.
    s.handle_bytes(
        t1 + Duration::from_millis(1500),
        b"\x02\x00\x00\x00\x00\x00\x01\x00",
    );
    s.handle_timeout(t1 + Duration::from_millis(2500)).unwrap();
    // Then silence: the next PING's deadline passes.
    let mut now;
    let err = loop {
        now = s.poll_timeout().unwrap();
        if let Err(e) = s.handle_timeout(now) {
            break e;
        }
    };
    assert!(
        matches!(err, Error::Timeout(TimeoutKind::Heartbeat)),
        "{err:?}"
    );
    assert!(now <= t1 + Duration::from_millis(1500) + Duration::from_secs(5));
    assert!(s.is_failed());
}

#[test]
fn peer_ttl_expires() {
    let t0 = Instant::now();
    let mut s = ready_sub(&Config::default(), 1, t0);
    s.handle_bytes(t0, b"\x04\x07\x04PING\x00\x0a"); // TTL 1 s
    events(&mut s).unwrap();
    assert_eq!(s.poll_timeout(), Some(t0 + Duration::from_secs(1)));
    let err = s.handle_timeout(t0 + Duration::from_secs(1)).unwrap_err();
    assert!(matches!(err, Error::Timeout(TimeoutKind::Heartbeat)));
}

#[test]
fn handshake_timeout() {
    let t0 = Instant::now();
    let config = Config::default();
    let mut s = Session::new(SocketType::Sub, &config, t0);
    s.handle_bytes(t0, &greeting(3, 1, b"NULL")[..20]);
    assert_eq!(s.poll_timeout(), Some(t0 + config.handshake_timeout()));
    s.handle_timeout(t0 + Duration::from_secs(9)).unwrap();
    let err = s.handle_timeout(t0 + Duration::from_secs(10)).unwrap_err();
    assert!(matches!(err, Error::Timeout(TimeoutKind::Handshake)));
    // Once failed, always failed.
    assert!(matches!(s.poll_event(), Err(Error::SocketClosed)));
}

fn handshake_error(peer_bytes: &[u8]) -> Error {
    let now = Instant::now();
    let mut s = Session::new(SocketType::Sub, &Config::default(), now);
    s.handle_bytes(now, peer_bytes);
    events(&mut s).unwrap_err()
}

#[test]
fn bad_greetings() {
    let err = handshake_error(b"\x00garbage");
    assert_eq!(err.protocol(), Some(&ProtocolError::BadSignature));
    let mut no_bit = greeting(3, 1, b"NULL");
    no_bit[9] = 0x7e;
    assert_eq!(
        handshake_error(&no_bit).protocol(),
        Some(&ProtocolError::BadSignature)
    );
    assert!(matches!(
        handshake_error(&greeting(2, 0, b"NULL")).protocol(),
        Some(ProtocolError::UnsupportedVersion { major: 2, .. })
    ));
    assert!(matches!(
        handshake_error(&greeting(3, 1, b"PLAIN")).protocol(),
        Some(ProtocolError::UnsupportedMechanism { mechanism }) if mechanism == "PLAIN"
    ));
}

#[test]
fn handshake_violations() {
    let mut g = greeting(3, 1, b"NULL");
    g.extend_from_slice(b"\x04\x0a\x05ERROR\x03bye");
    assert!(matches!(handshake_error(&g), Error::PeerError { reason } if reason == "bye"));

    let mut g = greeting(3, 1, b"NULL");
    g.extend_from_slice(b"\x00\x01x");
    assert!(matches!(
        handshake_error(&g).protocol(),
        Some(ProtocolError::UnexpectedDuringHandshake { .. })
    ));

    let mut g = greeting(3, 1, b"NULL");
    g.extend_from_slice(b"\x04\x06\x05HELLO");
    assert!(matches!(
        handshake_error(&g).protocol(),
        Some(ProtocolError::UnexpectedDuringHandshake { .. })
    ));

    let mut g = greeting(3, 1, b"NULL");
    g.extend_from_slice(&ready("REQ"));
    assert!(matches!(
        handshake_error(&g).protocol(),
        Some(ProtocolError::IncompatibleSocketType { .. })
    ));

    // READY larger than the metadata bound is refused from its header.
    let mut g = greeting(3, 1, b"NULL");
    g.extend_from_slice(b"\x06\x00\x00\x00\x00\x00\x10\x00\x01");
    assert!(matches!(
        handshake_error(&g).protocol(),
        Some(ProtocolError::CommandTooLarge { .. })
    ));
}

#[test]
fn missing_socket_type_is_accepted() {
    let now = Instant::now();
    let mut s = Session::new(SocketType::Sub, &Config::default(), now);
    s.handle_bytes(now, &greeting(3, 1, b"NULL"));
    s.handle_bytes(now, b"\x04\x06\x05READY");
    assert!(matches!(
        events(&mut s).unwrap().as_slice(),
        [Event::Ready(_)]
    ));
}

#[test]
fn after_handshake_more_on_command_is_fatal_unknown_is_counted() {
    let now = Instant::now();
    let mut s = ready_sub(&Config::default(), 1, now);
    s.handle_bytes(now, b"\x04\x06\x05HELLO");
    assert!(events(&mut s).unwrap().is_empty());
    assert_eq!(s.stats().unknown_commands, 1);
    s.handle_bytes(now, b"\x05\x05\x04PING");
    assert_eq!(
        events(&mut s).unwrap_err().protocol(),
        Some(&ProtocolError::CommandWithMore)
    );
}

#[test]
fn local_filter_drops_unsubscribed_and_cancelled() {
    let now = Instant::now();
    let mut s = ready_sub(&Config::default(), 1, now);
    s.subscribe(Bytes::from_static(b"kv"));
    let mut wire = BytesMut::new();
    for topic in ["kv-events", "other", "k", "kv"] {
        encode_message(&Message::from_parts([topic, "x"]), &mut wire);
    }
    s.handle_bytes(now, &wire);
    let got: Vec<_> = events(&mut s)
        .unwrap()
        .into_iter()
        .map(|e| match e {
            Event::Message(m) => m.part(0).unwrap(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(got, vec![Bytes::from("kv-events"), Bytes::from("kv")]);
    assert_eq!(s.stats().filtered, 2);
    // Messages still in flight after a CANCEL do not leak through.
    s.unsubscribe(b"kv");
    s.handle_bytes(now, &wire);
    assert!(events(&mut s).unwrap().is_empty());
    assert_eq!(s.stats().filtered, 6);
}

#[test]
fn publisher_accepts_both_subscription_forms_and_counts() {
    let now = Instant::now();
    let mut p = Session::new(SocketType::Pub, &Config::default(), now);
    p.handle_bytes(now, &greeting(3, 0, b"NULL"));
    p.handle_bytes(now, &ready("SUB"));
    p.handle_bytes(now, b"\x00\x03\x01kv"); // 3.0 form
    p.handle_bytes(now, b"\x04\x0c\x09SUBSCRIBEkv"); // 3.1 form, same prefix
    p.handle_bytes(now, b"\x00\x03\x00kv");
    p.handle_bytes(now, b"\x04\x09\x06CANCELkv");
    p.handle_bytes(now, b"\x00\x02\x02x"); // not a subscription
    let ev = events(&mut p).unwrap();
    assert_eq!(
        ev[1..],
        [
            Event::Subscribe(Bytes::from_static(b"kv")),
            Event::Cancel(Bytes::from_static(b"kv"))
        ]
    );
    assert_eq!(p.stats().ignored_messages, 1);
}

/// A PUB session with at most 2 subscriptions of at most 4 bytes, past its handshake.
fn limited_pub(now: Instant) -> Session {
    let config = Config::builder()
        .max_subscriptions(2)
        .max_subscription_size(4)
        .build()
        .unwrap();
    let mut p = Session::new(SocketType::Pub, &config, now);
    p.handle_bytes(now, &greeting(3, 1, b"NULL"));
    p.handle_bytes(now, &ready("SUB"));
    assert!(matches!(events(&mut p).unwrap()[..], [Event::Ready(_)]));
    p
}

#[test]
fn publisher_subscription_count_limit_at_its_boundary() {
    let now = Instant::now();
    let mut p = limited_pub(now);
    p.handle_bytes(now, &support::wire::subscribe(b"a"));
    p.handle_bytes(now, &support::wire::subscribe(b"b"));
    assert_eq!(events(&mut p).unwrap().len(), 2, "2 = max_subscriptions");
    // A repeat of a held prefix is a reference, not a new subscription.
    p.handle_bytes(now, &support::wire::subscribe(b"a"));
    assert!(events(&mut p).unwrap().is_empty());
    p.handle_bytes(now, &support::wire::subscribe(b"c"));
    assert_eq!(
        events(&mut p).unwrap_err().protocol(),
        Some(&ProtocolError::SubscriptionLimit {
            what: "more than max_subscriptions subscriptions"
        })
    );
}

#[test]
fn publisher_subscription_size_limit_at_its_boundary() {
    let now = Instant::now();
    // The SUBSCRIBE command form: 4 bytes accepted, 5 refused by the named limit.
    let mut p = limited_pub(now);
    p.handle_bytes(now, &support::wire::subscribe(b"abcd"));
    assert_eq!(
        events(&mut p).unwrap(),
        [Event::Subscribe(Bytes::from_static(b"abcd"))]
    );
    p.handle_bytes(now, &support::wire::subscribe(b"abcde"));
    assert_eq!(
        events(&mut p).unwrap_err().protocol(),
        Some(&ProtocolError::SubscriptionLimit {
            what: "subscription longer than max_subscription_size"
        })
    );
    // The 0x01-message form: a frame of 1 + 4 bytes accepted; 1 + 5 is refused at
    // its header, before its body is read (frames from a subscriber are capped at
    // max_subscription_size + 1).
    let mut p = limited_pub(now);
    p.handle_bytes(now, b"\x00\x05\x01abcd");
    assert_eq!(
        events(&mut p).unwrap(),
        [Event::Subscribe(Bytes::from_static(b"abcd"))]
    );
    p.handle_bytes(now, b"\x00\x06");
    assert_eq!(
        events(&mut p).unwrap_err().protocol(),
        Some(&ProtocolError::FrameTooLarge { size: 6, max: 5 })
    );
}

/// A SUB session subscribed to everything, with 1000-byte frames and 1500-byte
/// messages at most.
fn limited_sub(now: Instant) -> Session {
    let config = Config::builder()
        .max_frame_size(1000)
        .max_message_size(1500)
        .build()
        .unwrap();
    let mut s = ready_sub(&config, 1, now);
    s.subscribe(Bytes::new());
    drain(&mut s);
    s
}

fn message_of(parts: &[usize]) -> Vec<u8> {
    let mut wire = Vec::new();
    for (i, &len) in parts.iter().enumerate() {
        wire.extend_from_slice(&support::wire::frame(&vec![7u8; len], i + 1 < parts.len()));
    }
    wire
}

fn delivered_parts(s: &mut Session) -> Vec<usize> {
    match &events(s).unwrap()[..] {
        [Event::Message(m)] => m.parts().map(<[u8]>::len).collect(),
        other => panic!("expected one message, got {other:?}"),
    }
}

#[test]
fn frame_size_part_count_and_message_size_limits_at_their_boundaries() {
    // (parts accepted, parts refused one byte or one part past the limit, the error)
    let cases: [(&[usize], &[usize], ProtocolError); 3] = [
        (
            &[1000],
            &[1001],
            ProtocolError::FrameTooLarge {
                size: 1001,
                max: 1000,
            },
        ),
        (
            &[1000, 500],
            &[1000, 501],
            ProtocolError::MessageTooLarge {
                size: 1501,
                max: 1500,
            },
        ),
        (&[1; 64], &[1; 65], ProtocolError::TooManyParts { max: 64 }),
    ];
    let now = Instant::now();
    for (accepted, refused, error) in cases {
        let mut s = limited_sub(now);
        s.handle_bytes(now, &message_of(accepted));
        assert_eq!(delivered_parts(&mut s), accepted);
        s.handle_bytes(now, &message_of(refused));
        assert_eq!(events(&mut s).unwrap_err().protocol(), Some(&error));
    }
}

#[test]
fn ping_flood_leaves_one_pending_pong() {
    let now = Instant::now();
    let mut s = ready_sub(&Config::default(), 1, now);
    drain(&mut s);
    // A peer that floods PINGs without reading our PONGs: each answer replaces the
    // unsent one, so output stays one PONG (with the latest context) however many.
    for i in 0..20_000u32 {
        let mut ping = b"\x04\x0b\x04PING\x00\x00".to_vec();
        ping.extend_from_slice(&i.to_be_bytes());
        ping[1] = (ping.len() - 2) as u8;
        s.handle_bytes(now, &ping);
        events(&mut s).unwrap();
    }
    assert!(s.wants_input());
    assert_eq!(s.pending_output(), 4 + 7);
    let stats = s.stats();
    assert_eq!(
        (
            stats.pings_received,
            stats.pongs_sent,
            stats.pongs_coalesced
        ),
        (20_000, 1, 19_999)
    );
    assert_eq!(drain(&mut s), b"\x04\x09\x04PONG\x00\x00\x4e\x1f");
    assert_eq!(s.pending_output(), 0);
}

fn limits() -> FrameLimits {
    FrameLimits {
        max_frame_size: 1 << 20,
        max_message_size: 1 << 22,
        max_message_parts: 64,
        max_command_size: 1 << 10,
        strict: false,
    }
}

fn decode_split(wire: &[u8], cuts: &[usize]) -> Vec<Decoded> {
    let mut decoder = FrameDecoder::new(limits());
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut start = 0;
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
    points.push(wire.len());
    points.sort_unstable();
    for p in points {
        buf.extend_from_slice(&wire[start..p.max(start)]);
        start = p.max(start);
        while let Some(d) = decoder.decode(&mut buf).unwrap() {
            out.push(d);
        }
    }
    assert!(buf.is_empty());
    assert!(decoder.is_idle());
    out
}

#[test]
fn messages_survive_any_split() {
    cases(256, |rng| {
        let msgs = rng.vec(1..12, |r| {
            r.vec(1..6, |r| {
                let n = r.range(0..600);
                r.bytes(n)
            })
        });
        let cuts = rng.vec(0..40, |r| r.next_u64() as usize);
        let pings = rng.bool();
        let messages: Vec<Message> = msgs.into_iter().map(Message::from_parts).collect();
        let mut wire = BytesMut::new();
        let mut expected = Vec::new();
        for m in &messages {
            encode_message(m, &mut wire);
            expected.push(Decoded::Message(m.clone()));
            if pings {
                let cmd = Command::Ping {
                    ttl_deciseconds: 7,
                    context: Bytes::from_static(b"c"),
                };
                cmd.encode(&mut wire);
                let mut body = BytesMut::new();
                cmd.encode(&mut body);
                expected.push(Decoded::Command(body.split_off(2).freeze()));
            }
        }
        assert_eq!(&decode_split(&wire, &cuts), &expected);
    });
}

#[test]
fn one_byte_at_a_time() {
    let m = Message::from_parts([vec![1u8; 4], vec![2u8; 8], vec![3u8; 300]]);
    let mut wire = BytesMut::new();
    encode_message(&m, &mut wire);
    encode_message(&m, &mut wire);
    let cuts: Vec<usize> = (0..wire.len()).collect();
    let out = decode_split(&wire, &cuts);
    assert_eq!(out, vec![Decoded::Message(m.clone()), Decoded::Message(m)]);
}
