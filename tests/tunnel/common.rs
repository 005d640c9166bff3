//! What the tunnel tests share: the test bus and broker configurations, publishers
//! advertised in a memory discovery, and a bus that misbehaves on purpose.
#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic,
    dead_code,
    unreachable_pub
)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::support::within;
use bytes::Bytes;
use eventplane::discovery::{ChannelId, Discovery, MemoryDiscovery, Registration, Transport};
use eventplane::net::AddrFilter;
use eventplane::tunnel::{
    BrokerConfig, BusClients, EventBus, EventBusConfig, Limits, Secret, client_tls, server_tls,
};
use eventplane::zmtp::{Config, Message, PubSocket};

pub const TOKEN: &str = "test-token-0123456789";

/// The one shared test token, granted namespace "prod".
pub fn shared_clients() -> BusClients {
    BusClients::shared(&Secret::new(TOKEN).unwrap(), vec!["prod".to_owned()]).unwrap()
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tunnel")
        .join(name)
}

pub async fn bus() -> EventBus {
    bus_at("127.0.0.1:0").await
}

pub async fn bus_at(addr: &str) -> EventBus {
    bus_configured(addr, shared_clients(), EventBusConfig::default()).await
}

/// A bus on a free loopback port with `config`.
pub async fn bus_with(config: EventBusConfig) -> EventBus {
    bus_configured("127.0.0.1:0", shared_clients(), config).await
}

/// A bus on `addr` accepting `clients`, with `config`.
pub async fn bus_configured(addr: &str, clients: BusClients, config: EventBusConfig) -> EventBus {
    let tls = server_tls(fixture("bus.pem"), fixture("bus.key")).unwrap();
    EventBus::bind(addr, tls, clients, config).await.unwrap()
}

/// Polls `done` until it holds (bounded by the support deadline, not a timing claim).
pub async fn until(mut done: impl FnMut() -> bool) {
    within(async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// A broker of "prod" with the shared token; its publishers are on loopback, which
/// a broker refuses unless told otherwise.
pub fn broker_config(bus: &EventBus, id: &str, view: Arc<dyn Discovery>) -> BrokerConfig {
    strict_broker_config(bus, id, view).addr_filter(loopback())
}

/// [`broker_config`] with `BrokerConfig::new`'s own address filter: nothing reopened.
pub fn strict_broker_config(bus: &EventBus, id: &str, view: Arc<dyn Discovery>) -> BrokerConfig {
    BrokerConfig::new(
        format!("https://localhost:{}", bus.local_addr().port()),
        id,
        vec!["prod".to_owned()],
        Secret::new(TOKEN).unwrap(),
        client_tls(fixture("ca.pem")).unwrap(),
        view,
    )
}

/// Strict, with loopback reopened (the tests' publishers are there).
pub fn loopback() -> AddrFilter {
    AddrFilter::strict().allow_cidr("127.0.0.0/8".parse().unwrap())
}

/// Waits until `bus` has a broker for "prod".
pub async fn connected(bus: &EventBus) {
    within(async {
        while bus.brokers_for("prod").is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// A publisher advertised in `view` under "prod".
pub async fn publisher(view: &MemoryDiscovery, n: u64) -> (PubSocket, String, Registration) {
    let socket = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let endpoint = socket.local_endpoint().unwrap().to_owned();
    let registration = view
        .register(
            ChannelId::new("prod", "worker", "kv", n).unwrap(),
            Transport::zmq(endpoint.clone()),
        )
        .await
        .unwrap();
    (socket, endpoint, registration)
}

pub fn message(i: u64) -> Message {
    Message::from_parts([
        Bytes::from_static(b"kv"),
        Bytes::copy_from_slice(&i.to_be_bytes()),
        Bytes::from(vec![i as u8; (i as usize * 37) % 3000]),
    ])
}

/// A resolver that never answers: every lookup runs into the DNS deadline.
pub struct NeverResolves;

impl eventplane::tunnel::Resolver for NeverResolves {
    fn resolve(
        &self,
        _host: &str,
        _port: u16,
    ) -> eventplane::BoxFuture<'static, std::io::Result<Vec<std::net::SocketAddr>>> {
        Box::pin(std::future::pending())
    }
}

/// A resolver that never answers and counts the lookups it was asked for and the
/// most it held at once (a lookup ends when the broker drops it).
#[derive(Clone, Default)]
pub struct HeldLookups(Arc<HeldCounts>);

#[derive(Default)]
pub struct HeldCounts {
    asked: std::sync::atomic::AtomicUsize,
    now: std::sync::atomic::AtomicUsize,
    peak: std::sync::atomic::AtomicUsize,
}

impl HeldLookups {
    /// Lookups asked for so far.
    pub fn asked(&self) -> usize {
        self.0.asked.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The most lookups in flight at once.
    pub fn peak(&self) -> usize {
        self.0.peak.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl eventplane::tunnel::Resolver for HeldLookups {
    fn resolve(
        &self,
        _host: &str,
        _port: u16,
    ) -> eventplane::BoxFuture<'static, std::io::Result<Vec<std::net::SocketAddr>>> {
        use std::sync::atomic::Ordering::SeqCst;
        struct Held(Arc<HeldCounts>);
        impl Drop for Held {
            fn drop(&mut self) {
                self.0.now.fetch_sub(1, SeqCst);
            }
        }
        let counts = self.0.clone();
        counts.asked.fetch_add(1, SeqCst);
        let now = counts.now.fetch_add(1, SeqCst) + 1;
        counts.peak.fetch_max(now, SeqCst);
        let held = Held(counts);
        Box::pin(async move {
            let _held = held;
            std::future::pending().await
        })
    }
}

/// A resolver that answers every name with `addrs`, in order.
pub struct FixedResolver(pub Vec<std::net::SocketAddr>);

impl eventplane::tunnel::Resolver for FixedResolver {
    fn resolve(
        &self,
        _host: &str,
        _port: u16,
    ) -> eventplane::BoxFuture<'static, std::io::Result<Vec<std::net::SocketAddr>>> {
        let addrs = self.0.clone();
        Box::pin(async move { Ok(addrs) })
    }
}

/// A loopback listener that never accepts, its one-slot backlog already taken: a
/// connect to it hangs until its deadline (the root network namespace answers
/// connects to arbitrary addresses, so an "unroutable" address would not).
pub fn unaccepting_listener() -> (tokio::net::TcpListener, std::net::TcpStream, u16) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(([127, 0, 0, 1], 0).into()).unwrap();
    let listener = socket.listen(0).unwrap();
    let port = listener.local_addr().unwrap().port();
    let filler = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    (listener, filler, port)
}

/// How a [`ScriptedBus`] misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Script {
    /// Welcomes, then never sends another frame (no heartbeats) while keeping the
    /// connection and the session's body open.
    FallSilent,
    /// Subscribes stream 1 to the target, then never answers its data stream's head.
    HoldResponseHead,
    /// Allows one HTTP/2 stream per connection (the session's): stream 1's data
    /// stream never gets a slot.
    NoStreamSlot,
    /// Sends stream 1 a `subscribe` naming an announced publisher (as if the broker
    /// were a source), which a router's own session would never send a broker.
    AnnouncedTarget,
}

/// A bus that speaks the session protocol (through the public sans-IO
/// `RouterSession`) but misbehaves as its [`Script`] says, to drive the broker's
/// deadlines over real TLS + HTTP/2.
pub struct ScriptedBus {
    pub url: String,
    /// Sessions the broker opened.
    pub sessions: Arc<std::sync::atomic::AtomicU64>,
    /// What the broker said about streams.
    pub events: tokio::sync::mpsc::Receiver<eventplane::tunnel::protocol::SessionEvent>,
    /// When things happened, for deadline assertions.
    pub marks: Marks,
}

/// What a [`ScriptedBus`] marks in its timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    /// A session request arrived.
    Session,
    /// A welcome was sent.
    Welcomed,
    /// Stream 1 was subscribed.
    Subscribed,
}

/// A shared timeline of [`Mark`]s.
#[derive(Clone, Default)]
pub struct Marks(Arc<std::sync::Mutex<Vec<(Mark, std::time::Instant)>>>);

impl Marks {
    pub fn mark(&self, mark: Mark) {
        self.0
            .lock()
            .unwrap()
            .push((mark, std::time::Instant::now()));
    }

    /// Every time `mark` happened, in order.
    pub fn all(&self, mark: Mark) -> Vec<std::time::Instant> {
        let marks = self.0.lock().unwrap();
        marks
            .iter()
            .filter(|(m, _)| *m == mark)
            .map(|(_, t)| *t)
            .collect()
    }

    /// The first time `mark` happened.
    pub fn first(&self, mark: Mark) -> std::time::Instant {
        self.all(mark)[0]
    }
}

/// An HTTP/2 body fed by a channel.
struct ChanBody(tokio::sync::mpsc::Receiver<Bytes>);

impl http_body::Body for ChanBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(http_body::Frame::data(c))))
    }
}

impl ScriptedBus {
    pub async fn start(script: Script, limits: Limits, target: &str) -> ScriptedBus {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let acceptor = tokio_rustls::TlsAcceptor::from(
            server_tls(fixture("bus.pem"), fixture("bus.key")).unwrap(),
        );
        let sessions = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (events_tx, events) = tokio::sync::mpsc::channel(64);
        let marks = Marks::default();
        let (counted, target, marked) = (sessions.clone(), target.to_owned(), marks.clone());
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                let Ok(tls) = acceptor.accept(tcp).await else {
                    continue;
                };
                let (counted, events_tx, target, marked) = (
                    counted.clone(),
                    events_tx.clone(),
                    target.clone(),
                    marked.clone(),
                );
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let (counted, events_tx, target, marked) = (
                            counted.clone(),
                            events_tx.clone(),
                            target.clone(),
                            marked.clone(),
                        );
                        async move {
                            if req.uri().path() != "/bus/v1/session" {
                                // A data stream: its head never comes.
                                std::future::pending::<()>().await;
                            }
                            marked.mark(Mark::Session);
                            let session = counted.fetch_add(1, Ordering::Relaxed) + 1;
                            let (out, rx) = tokio::sync::mpsc::channel(64);
                            tokio::spawn(run_scripted_session(
                                script,
                                limits,
                                session,
                                target,
                                req.into_body(),
                                out,
                                events_tx,
                                marked,
                            ));
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(ChanBody(rx)))
                        }
                    },
                );
                let mut builder =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
                if script == Script::NoStreamSlot {
                    builder.max_concurrent_streams(1);
                }
                let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(tls), service);
                tokio::spawn(conn);
            }
        });
        ScriptedBus {
            url: format!("https://localhost:{port}"),
            sessions,
            events,
            marks,
        }
    }
}

// One scripted session's whole context, spelled out: a test helper, called once.
#[allow(clippy::too_many_arguments)]
async fn run_scripted_session(
    script: Script,
    limits: Limits,
    session_id: u64,
    target: String,
    mut body: hyper::body::Incoming,
    out: tokio::sync::mpsc::Sender<Bytes>,
    events: tokio::sync::mpsc::Sender<eventplane::tunnel::protocol::SessionEvent>,
    marks: Marks,
) {
    use eventplane::tunnel::protocol::{ControlDecoder, RouterSession, SessionEvent};
    use http_body::Body;
    let mut session = RouterSession::new(session_id, limits, std::time::Instant::now());
    let mut decoder = ControlDecoder::default();
    let mut silent = false;
    loop {
        while let Some(event) = session.poll_event() {
            if let SessionEvent::Welcomed { .. } = event {
                match script {
                    // The welcome itself still goes out below.
                    Script::FallSilent => {}
                    Script::AnnouncedTarget => {
                        let mut wire = Vec::new();
                        while let Some(frame) = session.poll_transmit() {
                            frame.encode(&mut wire);
                        }
                        eventplane::tunnel::protocol::Control::Subscribe {
                            stream_id: 1,
                            target: eventplane::tunnel::Target::Announced { publisher_id: 7 },
                        }
                        .encode(&mut wire);
                        if out.send(Bytes::from(wire)).await.is_err() {
                            return;
                        }
                        marks.mark(Mark::Subscribed);
                    }
                    _ => {
                        session
                            .subscribe(1, target.clone(), std::time::Instant::now())
                            .unwrap();
                        marks.mark(Mark::Subscribed);
                    }
                }
                continue;
            }
            let _ = events.send(event).await;
        }
        if !silent {
            let mut wire = Vec::new();
            while let Some(frame) = session.poll_transmit() {
                if matches!(frame, eventplane::tunnel::protocol::Control::Welcome(_)) {
                    marks.mark(Mark::Welcomed);
                    silent = script == Script::FallSilent;
                }
                frame.encode(&mut wire);
            }
            if !wire.is_empty() && out.send(Bytes::from(wire)).await.is_err() {
                return;
            }
        }
        if silent {
            // Read (and drop) what the broker says, answer nothing, time nothing out.
            let frame =
                std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await;
            if !matches!(frame, Some(Ok(_))) {
                return;
            }
            continue;
        }
        let timeout = session.poll_timeout().map(tokio::time::Instant::from_std);
        tokio::select! {
            frame = std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)) => {
                let Some(Ok(frame)) = frame else { return };
                if let Ok(data) = frame.into_data() {
                    let mut input = &data[..];
                    while let Some(f) = decoder.decode(&mut input).unwrap() {
                        session.handle(f, std::time::Instant::now());
                    }
                }
            }
            () = async {
                match timeout {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            } => session.handle_timeout(std::time::Instant::now()),
        }
    }
}

/// An HTTP/2 body with nothing in it (that stays open: the session's hello never
/// comes).
pub struct EmptyBody;

impl http_body::Body for EmptyBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Pending
    }
}
