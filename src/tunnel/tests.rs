//! The tunnel's protocol rules, without sockets, time passed in.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use std::time::{Duration, Instant};

use crate::tunnel::protocol::*;
use crate::wire::Dialect;

fn welcome(limits: Limits) -> Control {
    Control::Welcome(Welcome::new(PROTOCOL_VERSION, 3, limits))
}

fn all_frames() -> Vec<Control> {
    vec![
        Control::Hello(Hello::new(
            "broker-1",
            vec!["prod".into(), "staging".into()],
        )),
        welcome(Limits::default()),
        Control::Heartbeat,
        Control::Subscribe {
            stream_id: u64::MAX,
            target: "tcp://10.0.0.5:5557".into(),
        },
        Control::Unsubscribe { stream_id: 0 },
        Control::Drain {
            deadline: Duration::from_millis(1500),
            reason: DrainReason::Rebalance,
        },
        Control::StreamOpened { stream_id: 300 },
        Control::StreamRefused {
            stream_id: 70_000,
            code: RefuseCode::TargetNotAdvertised,
        },
        Control::StreamClosed {
            stream_id: 1 << 40,
            code: CloseCode::BufferOverflow,
        },
        Control::Draining,
        Control::Denied {
            code: DenyCode::NamespaceNotGranted,
        },
        Control::Hello(Hello::source(
            "gpu-1",
            vec!["prod".into()],
            vec![
                source(7, Dialect::EventPlane),
                source(8, Dialect::Dynamo)
                    .with_worker(crate::discovery::WorkerIdentity::new(42, 3)),
            ],
        )),
        Control::Subscribe {
            stream_id: 9,
            target: Target::Announced { publisher_id: 7 },
        },
        Control::Announce {
            sources: (1..=MAX_ANNOUNCE as u64)
                .map(|i| source(i, Dialect::EventPlane))
                .collect(),
        },
        Control::Withdraw {
            publisher_ids: vec![7, 1 << 52],
        },
        Control::AnnounceRefused {
            publisher_ids: vec![3, 1 << 52],
            code: AnnounceRefusal::HeldByAnotherSource,
        },
        Control::Unknown,
    ]
}

pub(crate) fn source(publisher_id: u64, wire: crate::wire::Dialect) -> AnnouncedSource {
    let id =
        crate::discovery::ChannelId::new("prod", "backend", "kv-events", publisher_id).unwrap();
    AnnouncedSource::new(&id, wire)
}

#[test]
fn every_frame_round_trips_through_any_split() {
    let frames = all_frames();
    let mut wire = Vec::new();
    for f in &frames {
        f.encode(&mut wire);
    }
    for cut in [1, 2, 3, 5, 7, 64, wire.len()] {
        let mut decoder = ControlDecoder::default();
        let mut out = Vec::new();
        for piece in wire.chunks(cut) {
            let mut input = piece;
            while let Some(f) = decoder.decode(&mut input).unwrap() {
                out.push(f);
            }
            assert!(input.is_empty());
        }
        assert_eq!(out, frames, "cut {cut}");
        assert_eq!(decoder.buffered(), 0);
    }
}

#[test]
fn every_code_round_trips_and_unknown_text_reads_as_unknown() {
    for code in RefuseCode::ALL {
        assert_eq!(RefuseCode::parse(code.as_str()), *code);
    }
    for code in CloseCode::ALL {
        assert_eq!(CloseCode::parse(code.as_str()), *code);
    }
    let mut wire = Vec::new();
    // A newer peer's code, and a newer peer's frame type.
    wire.extend_from_slice(&frame_of(&[
        ("type", Raw::Str("stream_closed")),
        ("stream_id", Raw::Uint(1)),
        ("code", Raw::Str("cosmic_ray")),
    ]));
    wire.extend_from_slice(&frame_of(&[("type", Raw::Str("teleport"))]));
    let (mut decoder, mut input) = (ControlDecoder::default(), &wire[..]);
    assert_eq!(
        decoder.decode(&mut input).unwrap(),
        Some(Control::StreamClosed {
            stream_id: 1,
            code: CloseCode::Unknown
        })
    );
    assert_eq!(decoder.decode(&mut input).unwrap(), Some(Control::Unknown));
}

/// Values for hand-made frames.
pub(crate) enum Raw<'a> {
    Str(&'a str),
    Uint(u64),
    Strs(&'a [&'a str]),
    Uints(&'a [u64]),
}

/// A frame built by hand (length prefix + a msgpack map), for hostile inputs.
pub(crate) fn frame_of(fields: &[(&str, Raw<'_>)]) -> Vec<u8> {
    fn str(out: &mut Vec<u8>, s: &str) {
        if s.len() < 256 {
            out.push(0xd9);
            out.push(s.len() as u8);
        } else {
            out.push(0xda);
            out.extend_from_slice(&(s.len() as u16).to_be_bytes());
        }
        out.extend_from_slice(s.as_bytes());
    }
    let mut body = vec![0x80 | fields.len() as u8];
    for (k, v) in fields {
        str(&mut body, k);
        match v {
            Raw::Str(s) => str(&mut body, s),
            Raw::Uint(u) => {
                body.push(0xcf);
                body.extend_from_slice(&u.to_be_bytes());
            }
            Raw::Strs(items) => {
                body.push(0xdc);
                body.extend_from_slice(&(items.len() as u16).to_be_bytes());
                for s in *items {
                    str(&mut body, s);
                }
            }
            Raw::Uints(items) => {
                body.push(0xdc);
                body.extend_from_slice(&(items.len() as u16).to_be_bytes());
                for u in *items {
                    body.push(0xcf);
                    body.extend_from_slice(&u.to_be_bytes());
                }
            }
        }
    }
    let mut out = (body.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(&body);
    out
}

pub(crate) fn decode_one(wire: &[u8]) -> Result<Option<Control>, FrameError> {
    let (mut decoder, mut input) = (ControlDecoder::default(), wire);
    decoder.decode(&mut input)
}

#[test]
fn hostile_frames_are_named_errors_and_never_buffered_beyond_the_limit() {
    // A forged length: refused from its 4 header bytes, nothing reserved.
    let mut decoder = ControlDecoder::new(1024);
    let mut input = &[0x00, 0x00, 0x04, 0x01, 0xaa][..];
    assert_eq!(
        decoder.decode(&mut input),
        Err(FrameError::Oversized {
            len: 1025,
            max: 1024
        })
    );
    // Not msgpack, not a map, no type.
    assert!(matches!(
        decode_one(&[0, 0, 0, 1, 0xc1]),
        Err(FrameError::NotMsgpack(_))
    ));
    assert!(matches!(
        decode_one(&[0, 0, 0, 1, 0x07]),
        Err(FrameError::NotMsgpack("not a map"))
    ));
    assert!(matches!(
        decode_one(&frame_of(&[("stream_id", Raw::Uint(1))])),
        Err(FrameError::Field { field: "type", .. })
    ));
    // An array claiming 65,535 elements in a few bytes: refused by the bounded reader.
    let mut claim = vec![0x81, 0xa4];
    claim.extend_from_slice(b"type");
    claim.extend_from_slice(&[0xdc, 0xff, 0xff]);
    let mut framed = (claim.len() as u32).to_be_bytes().to_vec();
    framed.extend_from_slice(&claim);
    assert!(matches!(
        decode_one(&framed),
        Err(FrameError::NotMsgpack(_))
    ));
    // Fields: missing, mistyped, out of bounds.
    // A subscribe's target that cannot be taken reads as empty: the broker refuses
    // that stream (`bad_target`), the session lives on.
    let long = format!("tcp://{}:1", "h".repeat(1100));
    for target in [
        None,
        Some(Raw::Uint(7)),
        Some(Raw::Str("")),
        Some(Raw::Str(&long)),
    ] {
        let mut fields = vec![("type", Raw::Str("subscribe")), ("stream_id", Raw::Uint(1))];
        fields.extend(target.map(|t| ("target", t)));
        assert_eq!(
            decode_one(&frame_of(&fields)),
            Ok(Some(Control::Subscribe {
                stream_id: 1,
                target: Target::Tcp(String::new())
            }))
        );
    }
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            frame_of(&[
                ("type", Raw::Str("subscribe")),
                ("stream_id", Raw::Str("one")),
                ("target", Raw::Str("tcp://h:1")),
            ]),
            "stream_id",
        ),
        (
            frame_of(&[
                ("type", Raw::Str("hello")),
                ("role", Raw::Str("router")),
                ("client_id", Raw::Str("b")),
                ("namespaces", Raw::Strs(&[])),
                ("versions", Raw::Uints(&[1])),
            ]),
            "role",
        ),
        (
            frame_of(&[
                ("type", Raw::Str("hello")),
                ("role", Raw::Str("broker")),
                ("client_id", Raw::Str("")),
                ("namespaces", Raw::Strs(&[])),
                ("versions", Raw::Uints(&[1])),
            ]),
            "client_id",
        ),
        (
            frame_of(&[
                ("type", Raw::Str("hello")),
                ("role", Raw::Str("broker")),
                ("client_id", Raw::Str("b")),
                ("namespaces", Raw::Strs(&["ns"; MAX_NAMESPACES + 1])),
                ("versions", Raw::Uints(&[1])),
            ]),
            "namespaces",
        ),
        (
            frame_of(&[
                ("type", Raw::Str("hello")),
                ("role", Raw::Str("broker")),
                ("client_id", Raw::Str("b")),
                ("namespaces", Raw::Strs(&["ns"])),
                ("versions", Raw::Uints(&[1 << 40])),
            ]),
            "versions",
        ),
        (
            frame_of(&[
                ("type", Raw::Str("welcome")),
                ("version", Raw::Uint(1)),
                ("session_id", Raw::Uint(1)),
                ("max_streams", Raw::Uint(1 << 33)),
                ("max_stream_buffer_bytes", Raw::Uint(1)),
                ("heartbeat_interval_ms", Raw::Uint(1)),
                ("idle_timeout_ms", Raw::Uint(2)),
            ]),
            "max_streams",
        ),
    ];
    for (wire, field) in cases {
        match decode_one(&wire) {
            Err(FrameError::Field { field: f, .. } | FrameError::OutOfBounds { field: f, .. }) => {
                assert_eq!(f, field);
            }
            other => panic!("{field}: {other:?}"),
        }
    }
}

#[test]
fn random_bytes_never_panic_and_stay_bounded() {
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..2000 {
        let len = (next() % 300) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        // Plausible headers half the time, so bodies get parsed.
        if next() % 2 == 0 && bytes.len() > 4 {
            let body = (bytes.len() - 4) as u32;
            bytes[..4].copy_from_slice(&body.to_be_bytes());
        }
        let mut decoder = ControlDecoder::new(256);
        let mut input = &bytes[..];
        while let Ok(Some(_)) = decoder.decode(&mut input) {}
        assert!(decoder.buffered() <= 4 + 256);
    }
}

pub(crate) fn welcomed_pair(limits: Limits, now: Instant) -> (BrokerSession, RouterSession) {
    let mut broker = BrokerSession::new(Hello::new("b1", vec!["prod".into()]), now);
    let mut router = RouterSession::new(11, limits, now);
    exchange(&mut broker, &mut router, now);
    assert!(matches!(
        broker.poll_event(),
        Some(BrokerEvent::Welcomed(w)) if w.limits == limits
    ));
    assert!(matches!(
        router.poll_event(),
        Some(SessionEvent::Welcomed { client_id, namespaces, version: 2, role: Role::Broker })
            if client_id == "b1" && namespaces == ["prod"]
    ));
    (broker, router)
}

/// Moves every queued frame both ways, through the codec, until both are quiet.
pub(crate) fn exchange(broker: &mut BrokerSession, router: &mut RouterSession, now: Instant) {
    loop {
        let mut moved = false;
        let mut wire = Vec::new();
        while let Some(f) = broker.poll_transmit() {
            f.encode(&mut wire);
        }
        let (mut d, mut input) = (ControlDecoder::default(), &wire[..]);
        while let Some(f) = d.decode(&mut input).unwrap() {
            router.handle(f, now);
            moved = true;
        }
        let mut wire = Vec::new();
        while let Some(f) = router.poll_transmit() {
            f.encode(&mut wire);
        }
        let (mut d, mut input) = (ControlDecoder::default(), &wire[..]);
        while let Some(f) = d.decode(&mut input).unwrap() {
            broker.handle(f, now);
            moved = true;
        }
        if !moved {
            return;
        }
    }
}

#[test]
fn a_stream_goes_subscribe_open_data_close() {
    let now = Instant::now();
    let (mut broker, mut router) = welcomed_pair(Limits::default(), now);
    router
        .subscribe(5, "tcp://10.0.0.5:5557".into(), now)
        .unwrap();
    exchange(&mut broker, &mut router, now);
    assert_eq!(
        broker.poll_event(),
        Some(BrokerEvent::Open {
            stream_id: 5,
            target: "tcp://10.0.0.5:5557".into()
        })
    );
    broker.stream_opened(5);
    exchange(&mut broker, &mut router, now);
    assert_eq!(router.poll_event(), Some(SessionEvent::Opened(5)));
    router.accept_data_stream(5).unwrap();
    // A second data stream for the same id is refused.
    assert_eq!(router.accept_data_stream(5), Err(RefuseCode::UnknownStream));
    broker.stream_closed(5, CloseCode::UpstreamClosed);
    exchange(&mut broker, &mut router, now);
    assert_eq!(
        router.poll_event(),
        Some(SessionEvent::Closed {
            stream_id: 5,
            code: CloseCode::UpstreamClosed
        })
    );
    assert_eq!((broker.streams(), router.streams()), (0, 0));
}

#[test]
fn the_data_stream_may_overtake_stream_opened_and_unsubscribe_closes_silently() {
    let now = Instant::now();
    let (mut broker, mut router) = welcomed_pair(Limits::default(), now);
    router.subscribe(1, "tcp://h:1".into(), now).unwrap();
    exchange(&mut broker, &mut router, now);
    assert!(matches!(
        broker.poll_event(),
        Some(BrokerEvent::Open { .. })
    ));
    router.accept_data_stream(1).unwrap();
    router.unsubscribe(1);
    exchange(&mut broker, &mut router, now);
    assert_eq!(
        broker.poll_event(),
        Some(BrokerEvent::Close { stream_id: 1 })
    );
    // Closing it afterwards says nothing: the router let go already.
    broker.stream_closed(1, CloseCode::UpstreamClosed);
    assert_eq!(broker.poll_transmit(), None);
}

#[test]
fn the_broker_refuses_what_it_cannot_take() {
    let now = Instant::now();
    let limits = Limits {
        max_streams: 1,
        ..Limits::default()
    };
    let mut broker = BrokerSession::new(Hello::new("b", vec![]), now);
    broker.poll_transmit();
    broker.handle(welcome(limits), now);
    let subscribe = |id, target: &str| Control::Subscribe {
        stream_id: id,
        target: target.into(),
    };
    broker.handle(subscribe(1, "10.0.0.5:5557"), now); // no scheme
    broker.handle(subscribe(2, "tcp://h:1"), now);
    broker.handle(subscribe(2, "tcp://h:1"), now); // same id
    broker.handle(subscribe(3, "tcp://h:2"), now); // over the limit
    broker.begin_draining();
    broker.stream_refused(2, RefuseCode::AddressFiltered); // the I/O layer's check
    broker.handle(subscribe(4, "tcp://h:3"), now); // draining
    let sent: Vec<Control> = std::iter::from_fn(|| broker.poll_transmit()).collect();
    let refused = |id, code| Control::StreamRefused {
        stream_id: id,
        code,
    };
    assert_eq!(
        sent,
        vec![
            refused(1, RefuseCode::BadTarget),
            refused(2, RefuseCode::DuplicateStream),
            refused(3, RefuseCode::TooManyStreams),
            Control::Draining,
            refused(2, RefuseCode::AddressFiltered),
            refused(4, RefuseCode::Draining),
        ]
    );
}

#[test]
fn heartbeats_keep_a_session_alive_and_silence_ends_it() {
    let t0 = Instant::now();
    let limits = Limits {
        heartbeat_interval: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(3),
        ..Limits::default()
    };
    let (mut broker, mut router) = welcomed_pair(limits, t0);
    // Both sides beat every second and hear each other: nothing ends.
    for s in 1..=10 {
        let now = t0 + Duration::from_secs(s);
        assert!(broker.poll_timeout().unwrap() <= now);
        broker.handle_timeout(now);
        router.handle_timeout(now);
        exchange(&mut broker, &mut router, now);
    }
    assert!(!broker.is_ended() && !router.is_ended());
    // The router goes silent: the broker ends the session at the idle timeout.
    let last = t0 + Duration::from_secs(10);
    broker.handle_timeout(last + Duration::from_millis(2999));
    assert!(!broker.is_ended());
    broker.handle_timeout(last + Duration::from_secs(3));
    assert!(broker.is_ended());
    let events: Vec<BrokerEvent> = std::iter::from_fn(|| broker.poll_event()).collect();
    assert_eq!(
        events.last(),
        Some(&BrokerEvent::Ended(SessionEnd::IdleTimeout(
            Duration::from_secs(3)
        )))
    );
}

#[test]
fn handshakes_have_deadlines_and_versions_must_meet() {
    let now = Instant::now();
    let mut broker = BrokerSession::new(Hello::new("b", vec![]), now);
    broker.handle_timeout(now + HANDSHAKE_TIMEOUT);
    assert_eq!(
        broker.poll_event(),
        Some(BrokerEvent::Ended(SessionEnd::HandshakeTimeout(
            HANDSHAKE_TIMEOUT
        )))
    );
    let mut router = RouterSession::new(1, Limits::default(), now);
    router.handle_timeout(now + HANDSHAKE_TIMEOUT);
    assert!(router.is_ended());
    // A hello offering only versions we do not speak.
    let mut router = RouterSession::new(1, Limits::default(), now);
    let mut hello = Hello::new("b", vec![]);
    hello.versions = vec![7, 8];
    router.handle(Control::Hello(hello), now);
    assert_eq!(
        router.poll_event(),
        Some(SessionEvent::Ended(SessionEnd::NoCommonVersion {
            offered: vec![7, 8]
        }))
    );
    // A welcome for a version the hello did not offer, or with unusable timers.
    let mut broker = BrokerSession::new(Hello::new("b", vec![]), now);
    broker.handle(Control::Welcome(Welcome::new(9, 1, Limits::default())), now);
    assert!(broker.is_ended());
    let mut broker = BrokerSession::new(Hello::new("b", vec![]), now);
    let silly = Limits {
        heartbeat_interval: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(5),
        ..Limits::default()
    };
    broker.handle(welcome(silly), now);
    assert!(broker.is_ended());
}

#[test]
fn pending_subscribes_expire_and_late_answers_are_ignored() {
    let now = Instant::now();
    let (mut broker, mut router) = welcomed_pair(Limits::default(), now);
    router.subscribe(9, "tcp://h:1".into(), now).unwrap();
    exchange(&mut broker, &mut router, now);
    // Heartbeats keep the session up while the subscribe waits for an answer.
    let later = now + PENDING_SUBSCRIBE_TIMEOUT;
    for s in [10, 20] {
        let t = now + Duration::from_secs(s);
        broker.handle_timeout(t);
        router.handle_timeout(t);
        exchange(&mut broker, &mut router, t);
    }
    broker.handle_timeout(later);
    exchange(&mut broker, &mut router, later);
    assert!(router.poll_timeout().unwrap() <= later);
    router.handle_timeout(later);
    assert_eq!(router.poll_event(), Some(SessionEvent::Expired(9)));
    // The router tells the broker to let go, and ignores the late opening.
    let sent: Vec<Control> = std::iter::from_fn(|| router.poll_transmit()).collect();
    assert!(
        sent.contains(&Control::Unsubscribe { stream_id: 9 }),
        "{sent:?}"
    );
    router.handle(Control::StreamOpened { stream_id: 9 }, later);
    assert_eq!(router.poll_event(), None);
    assert_eq!(router.accept_data_stream(9), Err(RefuseCode::UnknownStream));
}

#[test]
fn a_draining_broker_takes_no_new_subscribes() {
    let now = Instant::now();
    let (mut broker, mut router) = welcomed_pair(Limits::default(), now);
    assert!(router.is_available());
    broker.begin_draining();
    exchange(&mut broker, &mut router, now);
    assert_eq!(router.poll_event(), Some(SessionEvent::BrokerDraining));
    assert!(!router.is_available());
    assert_eq!(
        router.subscribe(1, "tcp://h:1".into(), now),
        Err(SubscribeError::Draining)
    );
    // The router drains another broker for a rebalance.
    let (mut other, mut session) = welcomed_pair(Limits::default(), now);
    session.drain(Duration::from_secs(2), DrainReason::Rebalance);
    exchange(&mut other, &mut session, now);
    assert_eq!(
        other.poll_event(),
        Some(BrokerEvent::Drain {
            deadline: Duration::from_secs(2),
            reason: DrainReason::Rebalance
        })
    );
    assert!(other.is_draining());
}

#[test]
fn a_peer_that_never_reads_cannot_grow_the_outbox() {
    let now = Instant::now();
    let (mut broker, _router) = welcomed_pair(Limits::default(), now);
    // The router floods subscribes and never reads the answers.
    for id in 0..=MAX_QUEUED_CONTROL as u64 {
        broker.handle(
            Control::Subscribe {
                stream_id: id,
                target: "no scheme".into(),
            },
            now,
        );
    }
    assert!(broker.is_ended());
    // Each refusal was told (for counting) until the session ended, nothing after.
    let events: Vec<BrokerEvent> = std::iter::from_fn(|| broker.poll_event()).collect();
    assert_eq!(events.len(), MAX_QUEUED_CONTROL + 1);
    assert_eq!(
        events.last(),
        Some(&BrokerEvent::Ended(SessionEnd::ControlBacklog))
    );
    assert_eq!(broker.poll_transmit(), None);
}

#[test]
fn wrong_roles_and_orders_are_protocol_errors() {
    let now = Instant::now();
    let mut router = RouterSession::new(1, Limits::default(), now);
    router.handle(Control::Heartbeat, now); // before hello
    assert!(matches!(
        router.poll_event(),
        Some(SessionEvent::Ended(SessionEnd::Protocol(_)))
    ));
    let (mut broker, mut router) = welcomed_pair(Limits::default(), now);
    router.handle(
        Control::Subscribe {
            stream_id: 1,
            target: "tcp://h:1".into(),
        },
        now,
    );
    assert!(router.is_ended());
    broker.handle(Control::Draining, now);
    assert!(broker.is_ended());
}

#[test]
fn rebalances_are_throttled() {
    let mut reconnect = Reconnect::default();
    let t0 = Instant::now();
    let d = reconnect.after_drain(DrainReason::Rebalance, t0, 0.0);
    assert_eq!(d, Duration::from_millis(250));
    // Within 60 s: the normal backoff (1 to 2 s on the first step), never the fast path.
    let d = reconnect.after_drain(DrainReason::Rebalance, t0 + Duration::from_secs(59), 0.0);
    assert_eq!(d, Duration::from_secs(1));
    let d = reconnect.after_drain(DrainReason::Rebalance, t0 + Duration::from_secs(59), 1.0);
    assert!(d > Duration::from_secs(2), "the backoff grows: {d:?}");
    // A minute after the last one, fast again.
    let d = reconnect.after_drain(DrainReason::Rebalance, t0 + Duration::from_secs(120), 1.0);
    assert_eq!(d, Duration::from_millis(500));
    // Failures back off up to 60 s.
    let mut reconnect = Reconnect::default();
    let worst = (0..20).map(|_| reconnect.after_failure(1.0)).max().unwrap();
    assert_eq!(worst, Duration::from_secs(60));
    reconnect.reset();
    assert_eq!(reconnect.after_failure(1.0), Duration::from_secs(2));
    assert_eq!(reconnect.after_failure(0.0), Duration::from_secs(1));
}

#[test]
fn an_unusable_target_is_refused_for_its_stream_and_the_session_lives_on() {
    let now = Instant::now();
    let (mut broker, mut router) = welcomed_pair(Limits::default(), now);
    // A router that sends 1.1 KiB (or any unusable) target: one stream refused.
    let long = format!("tcp://{}:1", "h".repeat(1100));
    let mut wire = Vec::new();
    Control::Subscribe {
        stream_id: 5,
        target: Target::Tcp(long.clone()),
    }
    .encode(&mut wire);
    let mut input = &wire[..];
    let frame = ControlDecoder::default()
        .decode(&mut input)
        .unwrap()
        .unwrap();
    broker.handle(frame, now);
    assert_eq!(
        broker.poll_transmit(),
        Some(Control::StreamRefused {
            stream_id: 5,
            code: RefuseCode::BadTarget
        })
    );
    assert!(!broker.is_ended());
    // Our router never sends one.
    for bad in [
        String::new(),
        long,
        "10.0.0.1:5557".into(),
        "tcp://h".into(),
    ] {
        assert_eq!(
            router.subscribe(6, bad.clone(), now),
            Err(SubscribeError::BadTarget),
            "{bad}"
        );
    }
    assert!(!router.has_transmit());
    assert!(router.subscribe(6, "tcp://h:1".into(), now).is_ok());
}

#[test]
fn a_hello_outside_its_grant_is_denied_on_both_sides() {
    let now = Instant::now();
    let grant = Grant::namespaces(vec!["prod".into()]).with_client_id("broker-a");
    for (hello, code) in [
        (
            Hello::new("broker-b", vec!["prod".into()]),
            DenyCode::ClientIdNotGranted,
        ),
        (
            Hello::new("broker-a", vec!["prod".into(), "dev".into()]),
            DenyCode::NamespaceNotGranted,
        ),
    ] {
        let mut router = RouterSession::new(1, Limits::default(), now).with_grant(grant.clone());
        let mut broker = BrokerSession::new(hello, now);
        router.handle(broker.poll_transmit().unwrap(), now);
        assert_eq!(
            router.poll_event(),
            Some(SessionEvent::Ended(SessionEnd::Denied(code)))
        );
        let denied = router.poll_transmit().unwrap();
        assert!(router.poll_transmit().is_none() && router.is_ended());
        // It crosses the wire, and ends the broker's session with the code.
        let mut wire = Vec::new();
        denied.encode(&mut wire);
        let mut input = &wire[..];
        broker.handle(
            ControlDecoder::default()
                .decode(&mut input)
                .unwrap()
                .unwrap(),
            now,
        );
        assert_eq!(
            broker.poll_event(),
            Some(BrokerEvent::Ended(SessionEnd::Denied(code)))
        );
    }
    // Its own id, and `--check-bus`'s `ID.check`, pass; a look-alike does not.
    assert!(
        grant
            .check(&Hello::new("broker-a", vec!["prod".into()]))
            .is_ok()
    );
    assert!(
        grant
            .check(&Hello::new("broker-a.check", vec!["prod".into()]))
            .is_ok()
    );
    assert!(
        grant
            .check(&Hello::new("broker-ab.check", vec!["prod".into()]))
            .is_err()
    );
    assert!(
        grant
            .check(&Hello::new("broker-a.checked", vec!["prod".into()]))
            .is_err()
    );
}

#[test]
fn a_full_session_says_so_and_a_forgotten_stream_frees_the_broker_slot() {
    let now = Instant::now();
    let (mut broker, mut router) = welcomed_pair(Limits::default().with_max_streams(1), now);
    router.subscribe(1, "tcp://h:1".into(), now).unwrap();
    assert!(!router.has_room());
    assert_eq!(
        router.subscribe(2, "tcp://h:1".into(), now),
        Err(SubscribeError::TooManyStreams)
    );
    broker.handle(router.poll_transmit().unwrap(), now);
    assert!(matches!(
        broker.poll_event(),
        Some(BrokerEvent::Open { stream_id: 1, .. })
    ));
    assert_eq!(broker.streams(), 1);
    // The router let go and its unsubscribe never came: the slot is free anyway.
    broker.stream_forgotten(1);
    assert_eq!(broker.streams(), 0);
    assert!(!broker.has_transmit());
}
