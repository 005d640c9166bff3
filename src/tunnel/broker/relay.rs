//! One relayed stream on the broker (DESIGN §7.2): the target checks, the connection
//! and the data stream, stage by stage under their deadlines, then the bytes both ways
//! within the relay budget.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use hyper::Request;
use hyper::client::conn::http2::SendRequest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::tunnel::broker::view::View;
use crate::tunnel::config::BrokerConfig;
use crate::tunnel::io::{BrokerBody, RelayQueue, next_chunk, relay_queue};
use crate::tunnel::protocol::codes::CodeCounts;
use crate::tunnel::{CloseCode, RefuseCode, RelayBudget};

/// What a stream task reports to its session: about `stream_id` as opened the
/// `generation`-th time (a router may reuse an id once it let go of it; a late report
/// of the earlier relay must not touch the new one).
pub(crate) struct Report {
    pub(crate) stream_id: u64,
    pub(crate) generation: u64,
    pub(crate) what: Reported,
}

pub(crate) enum Reported {
    Opened,
    Refused(RefuseCode),
    Closed(CloseCode),
    /// The router ended its side: the slot is free whether its unsubscribe comes or
    /// not.
    Gone,
}

/// What the relays of one session share.
pub(crate) struct Relay {
    /// One permit per data stream the router's concurrency limit allows.
    pub(crate) slots: Arc<tokio::sync::Semaphore>,
    pub(crate) config: BrokerConfig,
    pub(crate) view: View,
    pub(crate) sender: SendRequest<BrokerBody>,
    pub(crate) authority: String,
    pub(crate) budget: Arc<Mutex<RelayBudget>>,
    pub(crate) counters: Arc<Counters>,
}

/// A data stream through every stage: the publisher connected, the router answered.
struct Opened {
    tcp: TcpStream,
    /// Publisher → router: the data stream's request body.
    up: RelayQueue,
    /// Router → publisher: the data stream's response body.
    down: hyper::body::Incoming,
    /// Its HTTP/2 stream slot, held for its life.
    _slot: tokio::sync::OwnedSemaphorePermit,
}

/// Opens data stream `stream_id` to `target` stage by stage, then relays it.
pub(crate) async fn relay(
    ctx: Arc<Relay>,
    this: Report,
    target: String,
    report: mpsc::Sender<Report>,
    stop: CancellationToken,
) {
    let stream_id = this.stream_id;
    let tell = |what| Report { what, ..this };
    let opened = tokio::select! {
        () = stop.cancelled() => return,
        r = open(&ctx, stream_id, &target) => r,
    };
    let opened = match opened {
        Ok(opened) => opened,
        Err(code) => {
            let _ = report.send(tell(Reported::Refused(code))).await;
            return;
        }
    };
    let _ = report.send(tell(Reported::Opened)).await;
    ctx.counters.open.fetch_add(1, Ordering::Relaxed);
    let closed = pump(&ctx, stream_id, opened, &stop).await;
    ctx.counters.open.fetch_sub(1, Ordering::Relaxed);
    let last = match closed {
        Some(code) => Reported::Closed(code),
        None => Reported::Gone,
    };
    let _ = report.send(tell(last)).await;
}

/// The stages after the target checks, each under its deadline: the data stream's
/// slot, then the router's response head. A refusal resets the half-made stream.
async fn open(ctx: &Relay, stream_id: u64, target: &str) -> Result<Opened, RefuseCode> {
    let tcp = dial(ctx, target).await?;
    let deadlines = ctx.config.deadlines;
    // The slot stage: a permit under the welcome's stream limit, then hyper asking for
    // the body (the HTTP/2 stream is open), both within one deadline.
    let slot_deadline = tokio::time::Instant::now() + deadlines.stream_slot;
    let slot = match tokio::time::timeout_at(slot_deadline, ctx.slots.clone().acquire_owned()).await
    {
        Ok(Ok(permit)) => permit,
        Ok(Err(_)) => return Err(RefuseCode::StreamFailed),
        Err(_) => return Err(RefuseCode::StreamSlotTimeout),
    };
    ctx.budget
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .open(stream_id);
    // Unbounded in count, bounded in bytes: every chunk is charged (its length + 64 B)
    // before it is queued.
    let (started_tx, started) = oneshot::channel();
    let (up, body) = relay_queue(ctx.budget.clone(), stream_id, started_tx);
    let request = Request::post(format!(
        "https://{}/bus/v1/streams/{stream_id}",
        ctx.authority
    ))
    .header(
        hyper::header::AUTHORIZATION,
        ctx.config.token.header_value(),
    )
    .body(BrokerBody::Relay(body))
    .map_err(|_| RefuseCode::StreamFailed)?;
    let response = ctx.sender.clone().send_request(request);
    let staged = async {
        match tokio::time::timeout_at(slot_deadline, started).await {
            Ok(Ok(())) => {}
            // The request failed before it could be sent.
            Ok(Err(_)) => return Err(RefuseCode::StreamFailed),
            Err(_) => return Err(RefuseCode::StreamSlotTimeout),
        }
        match tokio::time::timeout(deadlines.response, response).await {
            Err(_) => Err(RefuseCode::ResponseTimeout),
            Ok(Ok(r)) if r.status().is_success() => Ok(r),
            Ok(Ok(r)) if r.status() == hyper::StatusCode::NOT_FOUND => {
                Err(RefuseCode::UnknownStream)
            }
            Ok(_) => Err(RefuseCode::StreamFailed),
        }
    };
    match staged.await {
        Ok(response) => Ok(Opened {
            tcp,
            up,
            down: response.into_body(),
            _slot: slot,
        }),
        Err(code) => {
            // The stream resets as soon as hyper polls its body.
            up.fail(std::io::Error::other(code.as_str()));
            Err(code)
        }
    }
}

/// The target checks and the connection, each stage under its deadline.
async fn dial(ctx: &Relay, target: &str) -> Result<TcpStream, RefuseCode> {
    if !ctx.view.advertised(target) {
        return Err(RefuseCode::TargetNotAdvertised);
    }
    let config = &ctx.config;
    let deadlines = config.deadlines;
    let (host, port) = crate::zmtp::parse_tcp(target).map_err(|_| RefuseCode::BadTarget)?;
    // At most `max_dns_lookups` in flight: a lookup runs to its end holding its slot,
    // even when its stream gave up on it (a system lookup cannot be cancelled), so
    // subscribe churn cannot pile lookups on the blocking pool.
    let dns = ctx.counters.dns.clone();
    let resolver = config.resolver.clone();
    let counters = ctx.counters.clone();
    let lookup = async move {
        let slot = match dns.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                counters.dns_saturated.fetch_add(1, Ordering::Relaxed);
                dns.acquire_owned()
                    .await
                    .map_err(|_| std::io::Error::other("stopped"))?
            }
        };
        tokio::spawn(async move {
            let _slot = slot;
            resolver.resolve(&host, port).await
        })
        .await
        .map_err(std::io::Error::other)?
    };
    let addrs = match tokio::time::timeout(deadlines.dns, lookup).await {
        Err(_) => return Err(RefuseCode::DnsTimeout),
        Ok(Err(_)) => return Err(RefuseCode::DnsFailed),
        Ok(Ok(addrs)) => addrs,
    };
    if addrs.is_empty() {
        return Err(RefuseCode::DnsFailed);
    }
    let allowed: Vec<std::net::SocketAddr> = addrs
        .into_iter()
        .filter(|a| config.addr_filter.check_socket(*a).is_ok())
        .collect();
    if allowed.is_empty() {
        return Err(RefuseCode::AddressFiltered);
    }
    let connect = async {
        let mut timed_out = false;
        for addr in &allowed {
            match tokio::time::timeout(deadlines.connect_attempt, TcpStream::connect(addr)).await {
                Ok(Ok(tcp)) => return Ok(tcp),
                Ok(Err(_)) => {}
                Err(_) => timed_out = true,
            }
        }
        Err(if timed_out {
            RefuseCode::ConnectTimeout
        } else {
            RefuseCode::ConnectFailed
        })
    };
    match tokio::time::timeout(deadlines.connect, connect).await {
        Ok(r) => {
            let tcp = r?;
            let _ = tcp.set_nodelay(true);
            Ok(tcp)
        }
        Err(_) => Err(RefuseCode::ConnectTimeout),
    }
}

/// Relays until either side ends; `Some(code)` when the broker must report the close
/// (`None` when the router let go first).
async fn pump(
    ctx: &Relay,
    stream_id: u64,
    opened: Opened,
    stop: &CancellationToken,
) -> Option<CloseCode> {
    let Opened {
        tcp,
        up: up_tx,
        down: mut body,
        _slot,
    } = opened;
    let (mut read, mut write) = tcp.into_split();
    let counters = &ctx.counters;
    // Publisher → router: read continuously; a chunk over budget resets the stream.
    // `Some(code)` when this side ends it, `None` when the router let go.
    let up = async move {
        // A relay holds it for its whole life (1,000 streams: 16 MiB).
        let mut buf = vec![0u8; crate::tunnel::RELAY_READ_BYTES];
        loop {
            let n = match read.read(&mut buf).await {
                Ok(0) | Err(_) => return Some(CloseCode::UpstreamClosed),
                Ok(n) => n,
            };
            counters.bytes_up.fetch_add(n as u64, Ordering::Relaxed);
            if up_tx.is_closed() {
                // The router let go of the stream (reset or done): not a close to
                // report.
                return None;
            }
            let charged = {
                let mut budget = ctx.budget.lock().unwrap_or_else(|p| p.into_inner());
                let charged = budget.charge(stream_id, n);
                counters
                    .high_water
                    .fetch_max(budget.high_water() as u64, Ordering::Relaxed);
                charged
            };
            let chunk = Bytes::copy_from_slice(buf.get(..n).unwrap_or_default());
            let sent = charged.is_ok() && up_tx.push(chunk);
            if !sent {
                // Over budget: the stream resets, and what it had queued stops
                // counting against the session right away.
                let mut budget = ctx.budget.lock().unwrap_or_else(|p| p.into_inner());
                budget.close(stream_id);
                drop(budget);
                // Its queue is dropped now, not when hyper next polls it.
                up_tx.fail(std::io::Error::other("buffer overflow"));
                return Some(CloseCode::BufferOverflow);
            }
        }
    };
    // `Some` when the publisher's side failed, `None` when the router ended its side.
    let down = async {
        while let Some(Ok(chunk)) = next_chunk(&mut body).await {
            counters
                .bytes_down
                .fetch_add(chunk.len() as u64, Ordering::Relaxed);
            if write.write_all(&chunk).await.is_err() {
                return Some(CloseCode::UpstreamClosed);
            }
        }
        None
    };
    tokio::select! {
        () = stop.cancelled() => None,
        code = up => code,
        // The router ended its side (it unsubscribes too): closed silently.
        code = down => code,
    }
}

/// A broker's counters and state shared by its sessions and relays.
pub(crate) struct Counters {
    pub(crate) sessions: AtomicU64,
    pub(crate) connected: std::sync::atomic::AtomicBool,
    pub(crate) session_failures: AtomicU64,
    pub(crate) streams_opened: AtomicU64,
    pub(crate) rebalances_throttled: AtomicU64,
    pub(crate) bytes_up: AtomicU64,
    pub(crate) bytes_down: AtomicU64,
    pub(crate) high_water: AtomicU64,
    pub(crate) refused: CodeCounts,
    pub(crate) closed: CodeCounts,
    pub(crate) denied: CodeCounts,
    /// DNS lookups in flight: one permit each.
    pub(crate) dns: Arc<tokio::sync::Semaphore>,
    /// Lookups that found every slot taken and waited.
    pub(crate) dns_saturated: AtomicU64,
    /// Streams relaying now.
    pub(crate) open: AtomicU64,
    /// Refusals warn once a minute per code, with the count suppressed.
    pub(crate) warn: crate::net::RateLimitedWarn,
    pub(crate) view: View,
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counters").finish_non_exhaustive()
    }
}
