//! The main types are `Send + Sync` (or `Send` where they hold a stream), so they can
//! live in spawned tasks and shared state.
#![allow(missing_docs, dead_code)]

use eventplane::discovery::{
    ChannelId, Discovery, DiscoveryError, DiscoveryEvent, DiscoveryStream, Instance,
    MemoryDiscovery, Query, Registration, StaticDiscovery,
};
use eventplane::lossy::{Lane, Merge};
use eventplane::publish::EventPublisher;
use eventplane::subscriber::{Delivery, DynamicSubscriber, SubscriberHandle, SubscriberStats};
use eventplane::zmtp::{
    Config, Error, Message, ProtocolError, PubSocket, PubStats, Session, SubSocket,
};

fn send_sync<T: Send + Sync>() {}
fn send<T: Send>() {}

#[test]
fn main_types_are_send_and_sync() {
    send_sync::<Config>();
    send_sync::<Error>();
    send_sync::<ProtocolError>();
    send_sync::<Message>();
    send_sync::<PubSocket>();
    send_sync::<PubStats>();
    send_sync::<Session>();
    send_sync::<SubSocket>();
    send_sync::<SubSocket<tokio::io::DuplexStream>>();
    send_sync::<eventplane::zmtp::DealerSocket>();
    send_sync::<eventplane::kv::engine::EngineReplayStats>();
    send_sync::<MemoryDiscovery>();
    send_sync::<StaticDiscovery>();
    send_sync::<std::sync::Arc<dyn Discovery>>();
    send_sync::<Registration>();
    send_sync::<DiscoveryError>();
    send_sync::<DiscoveryEvent>();
    send_sync::<ChannelId>();
    send_sync::<Instance>();
    send_sync::<Query>();
    send::<DiscoveryStream>();
    send_sync::<DynamicSubscriber>();
    send_sync::<SubscriberHandle>();
    send_sync::<SubscriberStats>();
    send_sync::<Delivery>();
    send_sync::<EventPublisher>();
    send_sync::<Merge<Delivery>>();
    send_sync::<eventplane::discovery::Merged>();
    send_sync::<eventplane::zmtp::StreamAcceptor>();
    send_sync::<Lane<Delivery>>();
}

#[test]
fn worker_types_are_send_and_sync() {
    use eventplane::kv::pipeline::{Worker, WorkerBuilder, WorkerStats};
    send_sync::<Worker>();
    send::<WorkerBuilder>();
    send_sync::<WorkerStats>();
    send_sync::<eventplane::discovery::WorkerIdentity>();
}

#[cfg(feature = "admin")]
#[test]
fn admin_types_are_send_and_sync() {
    send_sync::<eventplane::admin::AdminServer>();
    send_sync::<eventplane::admin::Routes>();
    send_sync::<eventplane::admin::AdminError>();
}

#[cfg(feature = "tunnel")]
#[test]
fn tunnel_types_are_send_and_sync() {
    use eventplane::tunnel::{
        Broker, BrokerConfig, BrokerStats, BusStats, EventBus, EventBusConfig, TunnelError,
        TunnelStream,
    };
    send_sync::<EventBus>();
    send_sync::<EventBusConfig>();
    send_sync::<eventplane::tunnel::Source>();
    send_sync::<eventplane::tunnel::SourceConfig>();
    send_sync::<eventplane::tunnel::SourceStats>();
    send_sync::<eventplane::tunnel::AnnouncedView>();
    send_sync::<eventplane::tunnel::AnnouncedSource>();
    send_sync::<eventplane::tunnel::Target>();
    send_sync::<BusStats>();
    send_sync::<Broker>();
    send_sync::<BrokerConfig>();
    send_sync::<BrokerStats>();
    send_sync::<TunnelStream>();
    send_sync::<TunnelError>();
}

#[cfg(all(feature = "tunnel", feature = "unstable"))]
#[test]
fn tunnel_protocol_types_are_send_and_sync() {
    use eventplane::tunnel::protocol::{
        BrokerSession, Control, ControlDecoder, FrameError, Reconnect, RelayBudget, RouterSession,
        SessionEnd,
    };
    send_sync::<BrokerSession>();
    send_sync::<RouterSession>();
    send_sync::<Control>();
    send_sync::<ControlDecoder>();
    send_sync::<FrameError>();
    send_sync::<SessionEnd>();
    send_sync::<Reconnect>();
    send_sync::<RelayBudget>();
}

#[cfg(feature = "etcd")]
#[test]
fn etcd_types_are_send_and_sync() {
    use eventplane::discovery::{EtcdDiscovery, EtcdDiscoveryBuilder, EtcdState};
    fn check<F: std::future::Future + Send>(_: F) {}
    send_sync::<EtcdDiscovery>();
    send_sync::<EtcdDiscoveryBuilder>();
    send_sync::<EtcdState>();
    check(EtcdDiscovery::connect(["http://127.0.0.1:1"]));
    let d: Option<EtcdDiscovery> = None;
    if let Some(d) = d.as_ref() {
        check(d.close());
        check(d.register(
            ChannelId::new("n", "c", "t", 1).unwrap(),
            eventplane::discovery::Transport::zmq("tcp://127.0.0.1:1"),
        ));
        check(d.watch(Query::new("n"), tokio_util::sync::CancellationToken::new()));
    }
}

#[test]
fn futures_are_send() {
    fn check<F: std::future::Future + Send>(_: F) {}
    let mut sub: Option<SubSocket> = None;
    if let Some(sub) = sub.as_mut() {
        check(sub.recv());
        check(sub.subscribe("x"));
    }
    check(SubSocket::connect("tcp://127.0.0.1:1", Config::default()));
    check(PubSocket::bind("tcp://127.0.0.1:0", Config::default()));
    let _ = send::<Box<dyn std::error::Error + Send + Sync>>;
}

#[cfg(feature = "metrics")]
#[test]
fn the_exporter_can_run_in_a_spawned_task() {
    // It owns closures reading stats (`FnMut + Send`): sent to its task, not shared.
    send::<eventplane::metrics::Exporter>();
    send_sync::<eventplane::metrics::Metric>();
}
