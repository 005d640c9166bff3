//! The source role's protocol rules (DESIGN §7.4), without sockets, time passed in:
//! announcements, targets by role, grants, limits and versions.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use std::time::Instant;

use crate::tunnel::protocol::*;
use crate::tunnel::tests::{Raw, decode_one, exchange, frame_of, source, welcomed_pair};
use crate::wire::Dialect;

/// A source `gpu-1` announcing `announced`, welcomed by a router held to `grant`.
fn source_pair(
    announced: Vec<AnnouncedSource>,
    grant: Grant,
    limits: Limits,
    now: Instant,
) -> (BrokerSession, RouterSession) {
    let mut client =
        BrokerSession::new(Hello::source("gpu-1", vec!["prod".into()], announced), now);
    let mut router = RouterSession::new(5, limits, now).with_grant(grant);
    exchange(&mut client, &mut router, now);
    (client, router)
}

#[test]
fn a_source_announces_withdraws_and_serves_only_what_it_announced() {
    let now = Instant::now();
    let grant = grant();
    let (mut client, mut router) = source_pair(
        vec![source(7, Dialect::EventPlane)],
        grant,
        Limits::default(),
        now,
    );
    assert!(matches!(client.poll_event(), Some(BrokerEvent::Welcomed(w)) if w.version == 2));
    assert!(matches!(
        router.poll_event(),
        Some(SessionEvent::Welcomed {
            role: Role::Source,
            version: 2,
            ..
        })
    ));
    assert_eq!(
        router.poll_event(),
        Some(SessionEvent::Announced(vec![source(
            7,
            Dialect::EventPlane
        )]))
    );
    // More than a frame holds go in several `announce` frames.
    let many: Vec<AnnouncedSource> = (100..100 + 2 * MAX_ANNOUNCE as u64 + 1)
        .map(|i| source(i, Dialect::Dynamo))
        .collect();
    client.announce(many.clone());
    exchange(&mut client, &mut router, now);
    let mut got = Vec::new();
    while let Some(SessionEvent::Announced(s)) = router.poll_event() {
        assert!(s.len() <= MAX_ANNOUNCE);
        got.extend(s);
    }
    assert_eq!(got, many);
    // The router asks for announced publishers only, and a source serves only those.
    assert_eq!(
        router.subscribe(1, "tcp://10.0.0.5:5557".into(), now),
        Err(SubscribeError::UnsupportedTarget)
    );
    assert_eq!(
        router.subscribe_to(1, Target::Announced { publisher_id: 99 }, now),
        Err(SubscribeError::NotAnnounced)
    );
    router
        .subscribe_to(1, Target::Announced { publisher_id: 7 }, now)
        .unwrap();
    exchange(&mut client, &mut router, now);
    assert_eq!(
        client.poll_event(),
        Some(BrokerEvent::Serve {
            stream_id: 1,
            publisher_id: 7
        })
    );
    // A source answers a `tcp://` target, an unknown kind, or an id it does not
    // announce with a refusal, and its session lives on.
    for (id, target, code) in [
        (
            2,
            Target::Tcp("tcp://10.0.0.5:5557".into()),
            RefuseCode::UnsupportedTarget,
        ),
        (3, Target::Unsupported, RefuseCode::UnsupportedTarget),
        (
            4,
            Target::Announced { publisher_id: 99 },
            RefuseCode::TargetNotAnnounced,
        ),
    ] {
        client.handle(
            Control::Subscribe {
                stream_id: id,
                target,
            },
            now,
        );
        assert_eq!(
            client.poll_event(),
            Some(BrokerEvent::Refused {
                stream_id: id,
                code
            })
        );
        assert_eq!(
            client.poll_transmit(),
            Some(Control::StreamRefused {
                stream_id: id,
                code
            })
        );
    }
    assert!(!client.is_ended());
    // Withdrawn: the router asks for it no more.
    client.withdraw(vec![7, 12345]);
    assert_eq!(
        client.poll_transmit(),
        Some(Control::Withdraw {
            publisher_ids: vec![7]
        })
    );
    router.handle(
        Control::Withdraw {
            publisher_ids: vec![7, 12345],
        },
        now,
    );
    assert_eq!(router.poll_event(), Some(SessionEvent::Withdrawn(vec![7])));
    assert_eq!(
        router.subscribe_to(5, Target::Announced { publisher_id: 7 }, now),
        Err(SubscribeError::NotAnnounced)
    );
}

#[test]
fn a_source_serves_the_recovery_log_of_a_publisher_announced_with_one_only() {
    let now = Instant::now();
    let grant = grant();
    let with_log = source(7, Dialect::EventPlane).with_recovery();
    let (mut client, mut router) = source_pair(
        vec![with_log.clone(), source(8, Dialect::EventPlane)],
        grant,
        Limits::default(),
        now,
    );
    while let Some(event) = router.poll_event() {
        if let SessionEvent::Announced(got) = event {
            // The flag crosses the wire.
            assert_eq!(got, vec![with_log.clone(), source(8, Dialect::EventPlane)]);
        }
    }
    let _ = client.poll_event();
    // The router asks only a publisher announced with a log for it.
    assert_eq!(
        router.subscribe_to(1, Target::Recovery { publisher_id: 8 }, now),
        Err(SubscribeError::NotAnnounced)
    );
    router
        .subscribe_to(1, Target::Recovery { publisher_id: 7 }, now)
        .unwrap();
    exchange(&mut client, &mut router, now);
    assert_eq!(
        client.poll_event(),
        Some(BrokerEvent::ServeRecovery {
            stream_id: 1,
            publisher_id: 7
        })
    );
    // The target's codec, both kinds.
    for target in [
        Target::Recovery { publisher_id: 7 },
        Target::Announced { publisher_id: 7 },
    ] {
        let frame = Control::Subscribe {
            stream_id: 9,
            target,
        };
        let mut wire = Vec::new();
        frame.encode(&mut wire);
        assert_eq!(decode_one(&wire), Ok(Some(frame)));
    }
}

#[test]
fn a_broker_refuses_announced_and_unknown_targets() {
    let now = Instant::now();
    let (mut broker, _router) = welcomed_pair(Limits::default(), now);
    for (id, target) in [
        (1, Target::Announced { publisher_id: 7 }),
        (2, Target::Unsupported),
        (3, Target::Recovery { publisher_id: 7 }),
    ] {
        broker.handle(
            Control::Subscribe {
                stream_id: id,
                target,
            },
            now,
        );
        let code = RefuseCode::UnsupportedTarget;
        assert_eq!(
            broker.poll_event(),
            Some(BrokerEvent::Refused {
                stream_id: id,
                code
            })
        );
        assert_eq!(
            broker.poll_transmit(),
            Some(Control::StreamRefused {
                stream_id: id,
                code
            })
        );
    }
    assert!(!broker.is_ended());
    // A broker never announces; a router never sends it an announced target.
    broker.announce(vec![source(7, Dialect::EventPlane)]);
    assert!(!broker.has_transmit());
}

#[test]
fn router_denies_an_announce_beyond_the_grant_or_the_limit() {
    let now = Instant::now();
    // A hostile source announcing another namespace mid-session.
    let (_client, mut router) = source_pair(vec![], grant(), Limits::default(), now);
    while router.poll_event().is_some() {}
    let id = crate::discovery::ChannelId::new("dev", "backend", "kv-events", 9).unwrap();
    router.handle(
        Control::Announce {
            sources: vec![AnnouncedSource::new(&id, Dialect::EventPlane)],
        },
        now,
    );
    assert_eq!(
        router.poll_transmit(),
        Some(Control::Denied {
            code: DenyCode::NamespaceNotGranted
        })
    );
    assert_eq!(
        router.poll_event(),
        Some(SessionEvent::Ended(SessionEnd::Denied(
            DenyCode::NamespaceNotGranted
        )))
    );
    // Past `max_sources`, in the hello or later.
    let limits = Limits::default().with_max_sources(2);
    let three: Vec<AnnouncedSource> = (1..=3).map(|i| source(i, Dialect::EventPlane)).collect();
    let (client, mut router) = source_pair(three, grant(), limits, now);
    assert_eq!(
        router.poll_event(),
        Some(SessionEvent::Ended(SessionEnd::Denied(
            DenyCode::TooManySources
        )))
    );
    assert!(client.is_ended());
    let (mut client, mut router) =
        source_pair(vec![source(1, Dialect::EventPlane)], grant(), limits, now);
    client.announce(vec![
        source(1, Dialect::EventPlane),
        source(2, Dialect::EventPlane),
    ]); // 1 again: still two
    exchange(&mut client, &mut router, now);
    assert!(!router.is_ended());
    client.announce(vec![source(3, Dialect::EventPlane)]);
    exchange(&mut client, &mut router, now);
    assert!(router.is_ended());
    assert!(matches!(
        client.poll_event(),
        Some(BrokerEvent::Welcomed(_))
    ));
    assert_eq!(
        client.poll_event(),
        Some(BrokerEvent::Ended(SessionEnd::Denied(
            DenyCode::TooManySources
        )))
    );
    // A credential naming workers: only those.
    let bound = Grant::namespaces(vec!["prod".into()])
        .with_role(Role::Source)
        .with_workers(vec![7]);
    let worker =
        |w| source(1, Dialect::EventPlane).with_worker(crate::discovery::WorkerIdentity::new(w, 0));
    assert_eq!(bound.check_source(&worker(7)), Ok(()));
    assert_eq!(
        bound.check_source(&worker(8)),
        Err(DenyCode::WorkerNotGranted)
    );
    assert_eq!(
        bound.check_source(&source(1, Dialect::EventPlane)),
        Err(DenyCode::WorkerNotGranted)
    );
    let (_client, mut router) = source_pair(vec![worker(8)], bound, Limits::default(), now);
    assert_eq!(
        router.poll_event(),
        Some(SessionEvent::Ended(SessionEnd::Denied(
            DenyCode::WorkerNotGranted
        )))
    );
    // No `.check` session for a source (it would announce under the grant twice).
    let mut router = RouterSession::new(1, Limits::default(), now).with_grant(grant());
    router.handle(
        Control::Hello(Hello::source("gpu-1.check", vec!["prod".into()], vec![])),
        now,
    );
    assert_eq!(
        router.poll_event(),
        Some(SessionEvent::Ended(SessionEnd::Denied(
            DenyCode::ClientIdNotGranted
        )))
    );
    // The same announcement again is no news (nothing for the views to do).
    let (mut client, mut router) = source_pair(
        vec![source(1, Dialect::EventPlane)],
        grant(),
        Limits::default(),
        now,
    );
    while router.poll_event().is_some() {}
    client.announce(vec![source(1, Dialect::EventPlane)]);
    exchange(&mut client, &mut router, now);
    assert_eq!(router.poll_event(), None);
    client.announce(vec![source(1, Dialect::Dynamo)]);
    exchange(&mut client, &mut router, now);
    assert_eq!(
        router.poll_event(),
        Some(SessionEvent::Announced(vec![source(1, Dialect::Dynamo)]))
    );
    // A broker's credential cannot take the source role, nor a broker announce.
    let broker_grant = Grant::namespaces(vec!["prod".into()]).with_role(Role::Broker);
    let (_client, mut router) = source_pair(vec![], broker_grant, Limits::default(), now);
    assert_eq!(
        router.poll_event(),
        Some(SessionEvent::Ended(SessionEnd::Denied(
            DenyCode::RoleNotGranted
        )))
    );
    let (_broker, mut router) = welcomed_pair(Limits::default(), now);
    router.handle(
        Control::Announce {
            sources: vec![source(1, Dialect::EventPlane)],
        },
        now,
    );
    assert!(matches!(
        router.poll_event(),
        Some(SessionEvent::Ended(SessionEnd::Protocol(_)))
    ));
}

#[test]
fn versions_are_negotiated_by_role() {
    let now = Instant::now();
    // A version-1 broker still meets this router at 1.
    let mut router = RouterSession::new(1, Limits::default(), now);
    let mut hello = Hello::new("b", vec![]);
    hello.versions = vec![1];
    router.handle(Control::Hello(hello), now);
    assert!(matches!(
        router.poll_event(),
        Some(SessionEvent::Welcomed { version: 1, .. })
    ));
    // A source offering only version 1 has no common version: the source role is 2.
    let mut router = RouterSession::new(1, Limits::default(), now);
    let mut hello = Hello::source("s", vec![], vec![]);
    hello.versions = vec![1];
    router.handle(Control::Hello(hello), now);
    assert!(matches!(
        router.poll_event(),
        Some(SessionEvent::Ended(SessionEnd::NoCommonVersion { .. }))
    ));
    // A source welcomed at version 1 (an old router) ends its side.
    let mut client = BrokerSession::new(Hello::source("s", vec![], vec![]), now);
    client.handle(Control::Welcome(Welcome::new(1, 1, Limits::default())), now);
    assert!(client.is_ended());
    // A version-1 welcome (no `max_sources`) decodes with the default.
    let v1 = frame_of(&[
        ("type", Raw::Str("welcome")),
        ("version", Raw::Uint(1)),
        ("session_id", Raw::Uint(1)),
        ("max_streams", Raw::Uint(8)),
        ("max_stream_buffer_bytes", Raw::Uint(1 << 20)),
        ("heartbeat_interval_ms", Raw::Uint(1000)),
        ("idle_timeout_ms", Raw::Uint(3000)),
    ]);
    let Ok(Some(Control::Welcome(w))) = decode_one(&v1) else {
        panic!("a version-1 welcome decodes")
    };
    assert_eq!(w.limits.max_sources, Limits::default().max_sources);
    // A hello naming a role this version does not know is a frame error.
    let unknown = frame_of(&[
        ("type", Raw::Str("hello")),
        ("role", Raw::Str("router")),
        ("client_id", Raw::Str("x")),
        ("namespaces", Raw::Strs(&[])),
        ("versions", Raw::Uints(&[2])),
    ]);
    assert!(matches!(
        decode_one(&unknown),
        Err(FrameError::OutOfBounds { field: "role", .. })
    ));
}

/// A publisher named many times in one `announce` is announced once, as its last entry
/// says; past [`ANNOUNCE_BURST`] frames at once and [`ANNOUNCES_PER_SECOND`] after, the
/// source is denied `announcing_too_fast` (issue 49 M1).
#[test]
fn one_publisher_per_id_and_announce_frames_are_rate_limited() {
    let now = Instant::now();
    let (_client, mut router) = source_pair(vec![], grant(), Limits::default(), now);
    while router.poll_event().is_some() {}
    let under = |c: usize| {
        let id = crate::discovery::ChannelId::new("prod", format!("c{c}"), "kv-events", 7).unwrap();
        AnnouncedSource::new(&id, Dialect::EventPlane)
    };
    router.handle(
        Control::Announce {
            sources: (0..MAX_ANNOUNCE).map(under).collect(),
        },
        now,
    );
    assert_eq!(
        router.poll_event(),
        Some(SessionEvent::Announced(vec![under(MAX_ANNOUNCE - 1)]))
    );
    // The burst (one frame spent above), then one more is too many at once.
    let frame = |i: u64| Control::Announce {
        sources: vec![source(100 + i, Dialect::EventPlane)],
    };
    for i in 1..u64::from(ANNOUNCE_BURST) {
        router.handle(frame(i), now);
    }
    assert!(!router.is_ended());
    // A second later, the rate's worth again.
    let later = now + std::time::Duration::from_secs(1);
    for i in 0..u64::from(ANNOUNCES_PER_SECOND) {
        router.handle(frame(i), later);
    }
    assert!(!router.is_ended());
    while router.poll_event().is_some() {}
    router.handle(frame(0), later);
    assert_eq!(
        router.poll_transmit(),
        Some(Control::Denied {
            code: DenyCode::AnnouncingTooFast
        })
    );
    assert_eq!(
        router.poll_event(),
        Some(SessionEvent::Ended(SessionEnd::Denied(
            DenyCode::AnnouncingTooFast
        )))
    );
}

/// A refusal goes back to the source: the publishers are no longer announced on the
/// session (a subscribe for one is refused), and the source is told which and why.
#[test]
fn refused_announcements_are_sent_back_to_the_source() {
    let now = Instant::now();
    let grant = grant();
    let (mut client, mut router) = source_pair(
        vec![
            source(7, Dialect::EventPlane),
            source(8, Dialect::EventPlane),
        ],
        grant,
        Limits::default(),
        now,
    );
    while router.poll_event().is_some() {}
    while client.poll_event().is_some() {}
    // 7 as announced, 8 as it was before a change the router holds since, 99 never.
    let before_a_change = AnnouncedSource {
        recovery: true,
        ..source(8, Dialect::EventPlane)
    };
    router.refuse_announced(
        AnnounceRefusal::HeldByAnotherSource,
        vec![
            source(7, Dialect::EventPlane),
            before_a_change,
            source(99, Dialect::EventPlane),
        ],
    );
    assert!(
        router
            .subscribe_to(2, Target::Announced { publisher_id: 8 }, now)
            .is_ok()
    );
    assert_eq!(
        router.subscribe_to(1, Target::Announced { publisher_id: 7 }, now),
        Err(SubscribeError::NotAnnounced)
    );
    exchange(&mut client, &mut router, now);
    assert_eq!(
        client.poll_event(),
        Some(BrokerEvent::AnnounceRefused {
            publisher_ids: vec![7],
            code: AnnounceRefusal::HeldByAnotherSource
        })
    );
    assert!(!client.is_ended() && !router.is_ended());
}

/// What `gpu-1`'s source credential grants: namespace "prod".
fn grant() -> Grant {
    Grant::namespaces(vec!["prod".into()])
        .with_client_id("gpu-1")
        .with_role(Role::Source)
}
