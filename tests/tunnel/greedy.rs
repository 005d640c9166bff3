//! What the `event_broker` process holds when the router is hostile: it grants every
//! stream and the connection 2^31 − 1 bytes of window, subscribes 1,024 streams, and
//! stops reading its socket. The broker's relay memory must stay within its session
//! budget plus `PER_STREAM_UNCHARGED_BYTES` per stream (DESIGN §7.2).
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use eventplane::tunnel::protocol::{
    ControlDecoder, MAX_SESSION_BUFFER_BYTES, PER_STREAM_UNCHARGED_BYTES, RouterSession,
    SessionEvent,
};
use eventplane::tunnel::{Limits, server_tls};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use crate::common::{EmptyBody, fixture};
use crate::support::{self, within};

const STREAMS: u64 = 1024;

/// A byte stream whose reads stop for good once `stalled` is set (its writes go on).
struct Stall<T> {
    io: T,
    stalled: Arc<AtomicBool>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Stall<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.stalled.load(Ordering::Relaxed) {
            return Poll::Pending;
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Stall<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// An HTTP/2 body fed by a channel.
struct Frames(tokio::sync::mpsc::Receiver<Bytes>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|c| c.map(|c| Ok(http_body::Frame::data(c))))
    }
}

/// The greedy bus: its URL, the data streams attached, and the switch that stops its
/// reads.
struct Greedy {
    url: String,
    attached: Arc<AtomicU64>,
    stalled: Arc<AtomicBool>,
}

async fn greedy_bus(target: String) -> Greedy {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "https://localhost:{}",
        listener.local_addr().unwrap().port()
    );
    let acceptor = tokio_rustls::TlsAcceptor::from(
        server_tls(fixture("bus.pem"), fixture("bus.key")).unwrap(),
    );
    let attached = Arc::new(AtomicU64::new(0));
    let stalled = Arc::new(AtomicBool::new(false));
    let (counted, stall) = (attached.clone(), stalled.clone());
    tokio::spawn(async move {
        // One connection: the broker's.
        let (tcp, _) = listener.accept().await.unwrap();
        let tls = acceptor.accept(tcp).await.unwrap();
        let service =
            hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let (counted, target) = (counted.clone(), target.clone());
                async move {
                    if req.uri().path() != "/bus/v1/session" {
                        // A data stream: answered, its body (the publisher's bytes) never
                        // read; held open.
                        counted.fetch_add(1, Ordering::Relaxed);
                        let body = req.into_body();
                        tokio::spawn(async move {
                            let _unread = body;
                            std::future::pending::<()>().await;
                        });
                        return Ok::<_, std::convert::Infallible>(hyper::Response::new(
                            http_body_util_either::Either::Left(EmptyBody),
                        ));
                    }
                    let (out, rx) = tokio::sync::mpsc::channel(64);
                    tokio::spawn(session(req.into_body(), out, target));
                    Ok(hyper::Response::new(http_body_util_either::Either::Right(
                        Frames(rx),
                    )))
                }
            });
        let io = Stall {
            io: tls,
            stalled: stall,
        };
        let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(u32::MAX >> 1)
            .initial_connection_window_size(u32::MAX >> 1)
            .max_concurrent_streams(2 * STREAMS as u32)
            .serve_connection(hyper_util::rt::TokioIo::new(io), service)
            .await;
    });
    Greedy {
        url,
        attached,
        stalled,
    }
}

/// The session: welcome, then `STREAMS` subscribes to `target`; heartbeats go on.
async fn session(
    mut body: hyper::body::Incoming,
    out: tokio::sync::mpsc::Sender<Bytes>,
    target: String,
) {
    use http_body::Body;
    let now = std::time::Instant::now;
    let limits = Limits::default().with_max_streams(STREAMS as u32);
    let mut session = RouterSession::new(1, limits, now());
    let mut decoder = ControlDecoder::default();
    loop {
        while let Some(event) = session.poll_event() {
            if let SessionEvent::Welcomed { .. } = event {
                for id in 1..=STREAMS {
                    session.subscribe(id, target.clone(), now()).unwrap();
                }
            }
        }
        let mut wire = Vec::new();
        while let Some(frame) = session.poll_transmit() {
            frame.encode(&mut wire);
        }
        if !wire.is_empty() && out.send(Bytes::from(wire)).await.is_err() {
            return;
        }
        let timeout = session.poll_timeout().map(tokio::time::Instant::from_std);
        tokio::select! {
            frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)) => {
                let Some(Ok(frame)) = frame else { return };
                if let Ok(data) = frame.into_data() {
                    let mut input = &data[..];
                    while let Ok(Some(f)) = decoder.decode(&mut input) {
                        session.handle(f, now());
                    }
                }
            }
            () = async {
                match timeout {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            } => session.handle_timeout(now()),
        }
    }
}

/// `http_body_util::Either` without the dependency: one of two bodies.
mod http_body_util_either {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    pub(super) enum Either<L, R> {
        Left(L),
        Right(R),
    }

    impl<L, R> http_body::Body for Either<L, R>
    where
        L: http_body::Body<Data = bytes::Bytes, Error = std::convert::Infallible> + Unpin,
        R: http_body::Body<Data = bytes::Bytes, Error = std::convert::Infallible> + Unpin,
    {
        type Data = bytes::Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
            match self.get_mut() {
                Either::Left(l) => Pin::new(l).poll_frame(cx),
                Either::Right(r) => Pin::new(r).poll_frame(cx),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_greedy_router_that_stops_reading_holds_the_broker_to_its_budget() {
    // The publishers: every connection gets 2 MiB, then is held open.
    let publisher = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", publisher.local_addr().unwrap());
    let written = Arc::new(AtomicU64::new(0));
    let sent = written.clone();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = publisher.accept().await {
            let sent = sent.clone();
            tokio::spawn(async move {
                let chunk = vec![7u8; 64 << 10];
                for _ in 0..32 {
                    if tcp.write_all(&chunk).await.is_err() {
                        return;
                    }
                    sent.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                }
                std::future::pending::<()>().await;
            });
        }
    });
    let bus = greedy_bus(endpoint.clone()).await;
    let dir = std::env::temp_dir().join(format!("eventplane-greedy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("token"), "greedy-test-token").unwrap();
    let config = dir.join("broker.toml");
    std::fs::write(
        &config,
        format!(
            "bus_url = {:?}\nclient_id = \"broker-a\"\nca_file = {:?}\ntoken_file = {:?}\n\
             allowed_cidrs = [\"127.0.0.0/8\"]\n[discovery]\nnamespaces = [\"prod\"]\n\
             static_endpoints = [{endpoint:?}]\n",
            bus.url,
            fixture("ca.pem"),
            dir.join("token"),
        ),
    )
    .unwrap();
    // EVENT_BROKER_BIN runs another build (an earlier commit's, for its figure).
    let program = std::env::var_os("EVENT_BROKER_BIN").map_or_else(
        || support::example("event-broker"),
        std::path::PathBuf::from,
    );
    let broker = tokio::process::Command::new(program)
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "off")
        .env(
            support::FIXED_MMAP_THRESHOLD.0,
            support::FIXED_MMAP_THRESHOLD.1,
        )
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = broker.id().unwrap();
    within(async {
        while bus.attached.load(Ordering::Relaxed) < STREAMS {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // Every stream attached: the router stops reading.
    bus.stalled.store(true, Ordering::Relaxed);
    // Until the flood is in (64 MiB written, the session budget) and the publishers'
    // writes have settled (the broker reads no more, or resets streams).
    let deadline = tokio::time::Instant::now() + support::DEADLINE;
    let mut last = u64::MAX;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = written.load(Ordering::Relaxed);
        if now >= (64 << 20) && now == last {
            break;
        }
        last = now;
        assert!(
            tokio::time::Instant::now() < deadline,
            "the publishers wrote {} MiB in {:?}, not yet settled at 64 MiB or more",
            now >> 20,
            support::DEADLINE
        );
    }
    let peak = support::proc_status_bytes(pid, "VmHWM");
    let bound = (MAX_SESSION_BUFFER_BYTES + STREAMS as usize * PER_STREAM_UNCHARGED_BYTES) as u64
        + (16 << 20);
    eprintln!(
        "figure: event_broker, 1,024 streams of 2 MiB toward a router granting 2^31-1 \
         windows and reading nothing: {} KiB peak RSS, publishers wrote {} MiB (bound {} KiB)",
        peak >> 10,
        last >> 20,
        bound >> 10
    );
    assert!(peak <= bound, "peak RSS {peak} B over the bound {bound} B");
    // The measure saw the flood (a broker that read nothing would pass the bound).
    assert!(last >= (64 << 20), "the publishers wrote only {last} B");
}
