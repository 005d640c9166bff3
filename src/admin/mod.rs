//! An admin endpoint for the processes built on the crate: `GET /metrics` (what the
//! application's recorder renders, Prometheus text for instance), `GET /readyz` (200
//! once the process says it is ready, 503 with its reason before) and `GET /livez`
//! (200 while it serves).
//!
//! It is small on purpose, a probe and scrape target rather than a web server: HTTP/1.1,
//! one request per connection, `GET` and `HEAD` only, a request head of at most
//! [`AdminConfig::max_request_bytes`] read within [`AdminConfig::request_timeout`]
//! and never a body; at most [`AdminConfig::max_connections`] served at once, so a
//! flood of connections costs a bounded amount of memory. When every slot is taken, a
//! new connection takes the slot of the oldest one still waiting for its request head
//! (or lingering after its answer), which is closed and counted: connections that send
//! nothing cannot keep a probe out. Only when every slot is busy answering is the new
//! connection closed on accept (counted).
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicBool, Ordering};
//! use eventplane::admin::{AdminConfig, AdminServer, Routes};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let ready = Arc::new(AtomicBool::new(false));
//! let flag = ready.clone();
//! let routes = Routes::new(move || {
//!     if flag.load(Ordering::Relaxed) { Ok(()) } else { Err("discovery not synced yet".into()) }
//! })
//! .metrics(|| "# no metrics yet\n".to_owned());
//! let admin = AdminServer::bind("127.0.0.1:0", AdminConfig::default(), routes).await?;
//! println!("probes on http://{}/readyz", admin.local_addr());
//! ready.store(true, Ordering::Relaxed);
//! admin.shutdown().await;
//! # Ok(()) }
//! ```

mod http;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::ConfigError;
use crate::net::RateLimitedWarn;

/// The bounds of an [`AdminServer`].
///
/// ```
/// use std::time::Duration;
/// use eventplane::admin::AdminConfig;
/// let config = AdminConfig::default()
///     .max_connections(4)
///     .request_timeout(Duration::from_secs(2));
/// assert!(config.validate().is_ok());
/// assert!(AdminConfig::default().max_request_bytes(16).validate().is_err());
/// ```
#[derive(Debug, Clone)]
pub struct AdminConfig {
    max_connections: usize,
    request_timeout: Duration,
    max_request_bytes: usize,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            max_connections: 8,
            request_timeout: Duration::from_secs(5),
            max_request_bytes: 4 << 10,
        }
    }
}

/// Smallest request head limit accepted (a probe's request is about 100 bytes).
const MIN_REQUEST_BYTES: usize = 256;
/// Largest request head limit accepted.
const MAX_REQUEST_BYTES: usize = 64 << 10;

impl AdminConfig {
    /// Connections served at once; more are closed as soon as they are accepted.
    /// Default 8.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n;
        self
    }

    /// Time for a connection to send its request head and take the answer; a slower
    /// one is closed. Default 5 s.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// The longest request head (request line and headers) read: a longer one gets
    /// 431. Default 4 KiB; from 256 B to 64 KiB.
    pub fn max_request_bytes(mut self, n: usize) -> Self {
        self.max_request_bytes = n;
        self
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        crate::config::nonzero("max_connections", self.max_connections)?;
        crate::config::nonzero_duration("request_timeout", self.request_timeout)?;
        if !(MIN_REQUEST_BYTES..=MAX_REQUEST_BYTES).contains(&self.max_request_bytes) {
            return Err(ConfigError::OutOfRange {
                field: "max_request_bytes",
                reason: "must be from 256 B to 64 KiB",
            });
        }
        Ok(())
    }
}

type Render = Arc<dyn Fn() -> String + Send + Sync>;
type Ready = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// What an [`AdminServer`] answers: readiness always, metrics when given.
///
/// ```
/// use eventplane::admin::Routes;
/// let routes = Routes::new(|| Ok(())); // /readyz always 200, /metrics 404
/// let routes = routes.metrics(|| "up 1\n".to_owned());
/// # drop(routes);
/// ```
#[derive(Clone)]
pub struct Routes {
    ready: Ready,
    metrics: Option<Render>,
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes")
            .field("metrics", &self.metrics.is_some())
            .finish_non_exhaustive()
    }
}

impl Routes {
    /// `/readyz` answers 200 while `ready` returns `Ok`, 503 with the reason it
    /// returns otherwise (called once per probe: keep it cheap).
    pub fn new(ready: impl Fn() -> Result<(), String> + Send + Sync + 'static) -> Routes {
        Routes {
            ready: Arc::new(ready),
            metrics: None,
        }
    }

    /// `/metrics` answers `render()`'s text as Prometheus' text exposition format
    /// (`text/plain; version=0.0.4`).
    pub fn metrics(mut self, render: impl Fn() -> String + Send + Sync + 'static) -> Routes {
        self.metrics = Some(Arc::new(render));
        self
    }
}

/// Counters of an [`AdminServer`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct AdminStats {
    /// Requests answered (any status).
    pub requests: u64,
    /// Connections closed on accept because `max_connections` were busy answering.
    pub refused_connections: u64,
    /// Connections closed to make room while they waited for their request head (or
    /// lingered after their answer): `max_connections` were taken when another came.
    pub evicted_connections: u64,
    /// Requests answered 400 or 431.
    pub bad_requests: u64,
    /// Connections closed for not sending a request head, or not taking the answer,
    /// within `request_timeout`.
    pub timeouts: u64,
}

#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    refused: AtomicU64,
    evicted: AtomicU64,
    bad: AtomicU64,
    timeouts: AtomicU64,
}

/// Reads a running [`AdminServer`]'s counters, from [`AdminServer::handle`] (for a
/// metrics exporter).
#[derive(Debug, Clone)]
pub struct AdminHandle {
    counters: Arc<Counters>,
}

impl AdminHandle {
    /// A snapshot of the counters.
    pub fn stats(&self) -> AdminStats {
        stats_of(&self.counters)
    }
}

fn stats_of(c: &Counters) -> AdminStats {
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    AdminStats {
        requests: l(&c.requests),
        refused_connections: l(&c.refused),
        evicted_connections: l(&c.evicted),
        bad_requests: l(&c.bad),
        timeouts: l(&c.timeouts),
    }
}

/// Why an [`AdminServer`] did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// A configuration value is out of its range.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A running admin endpoint; it stops on [`shutdown`](Self::shutdown) or drop.
#[derive(Debug)]
pub struct AdminServer {
    local_addr: SocketAddr,
    counters: Arc<Counters>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for AdminServer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl AdminServer {
    /// Listens on `addr` (`host:port`; port 0 picks one) and serves `routes`.
    pub async fn bind(
        addr: &str,
        config: AdminConfig,
        routes: Routes,
    ) -> Result<AdminServer, AdminError> {
        config.validate()?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| AdminError::Bind {
                addr: addr.to_owned(),
                source,
            })?;
        let local_addr = listener.local_addr().map_err(|source| AdminError::Bind {
            addr: addr.to_owned(),
            source,
        })?;
        let counters = Arc::new(Counters::default());
        let cancel = CancellationToken::new();
        let task = tokio::spawn(serve(
            listener,
            Arc::new(config),
            routes,
            counters.clone(),
            cancel.clone(),
        ));
        tracing::info!(%local_addr, "admin endpoint listening");
        Ok(AdminServer {
            local_addr,
            counters,
            cancel,
            task,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// A snapshot of its counters.
    pub fn stats(&self) -> AdminStats {
        stats_of(&self.counters)
    }

    /// A cloneable handle reading the counters.
    pub fn handle(&self) -> AdminHandle {
        AdminHandle {
            counters: self.counters.clone(),
        }
    }

    /// Stops listening and waits for the accept loop to end (connections being
    /// served end with it).
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        let _ = (&mut self.task).await;
    }
}

/// What a lingering close reads at most after the answer.
const LINGER_BYTES: usize = 8 << 10;
/// How long a lingering close waits for the client to close.
const LINGER_TIME: Duration = Duration::from_secs(1);
/// How long an accept waits for the slot of a connection it evicted.
const EVICT_WAIT: Duration = Duration::from_millis(100);

/// The connections that may be closed to make room: those waiting for their request
/// head or lingering after their answer, oldest first (at most `max_connections`).
#[derive(Default)]
struct Evictable {
    next: AtomicU64,
    queue: std::sync::Mutex<std::collections::VecDeque<(u64, CancellationToken)>>,
}

impl Evictable {
    fn queue(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::VecDeque<(u64, CancellationToken)>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, evict: &CancellationToken) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.queue().push_back((id, evict.clone()));
        id
    }

    fn remove(&self, id: u64) {
        self.queue().retain(|(i, _)| *i != id);
    }

    /// Closes the oldest evictable connection; `false` when there is none.
    fn evict_oldest(&self) -> bool {
        let oldest = self.queue().pop_front();
        oldest.map(|(_, evict)| evict.cancel()).is_some()
    }
}

async fn serve(
    listener: TcpListener,
    config: Arc<AdminConfig>,
    routes: Routes,
    counters: Arc<Counters>,
    cancel: CancellationToken,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(config.max_connections));
    let evictable = Arc::new(Evictable::default());
    let warn = RateLimitedWarn::default();
    let connections = tokio_util::task::TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => break,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            // A connection that went before it was accepted: the next one.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                continue;
            }
            Err(e) => {
                // Out of descriptors or memory, most likely: wait instead of spinning.
                if let Some(suppressed) = warn.check("accept", Instant::now()) {
                    tracing::warn!(error = %e, suppressed, "admin endpoint cannot accept; retrying");
                }
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_millis(100)) => continue,
                }
            }
        };
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => Some(slot),
            // Full: the oldest connection waiting for its head (or lingering) makes
            // room; its task ends at once and gives its slot back.
            Err(_) if evictable.evict_oldest() => {
                counters.evicted.fetch_add(1, Ordering::Relaxed);
                tokio::time::timeout(EVICT_WAIT, slots.clone().acquire_owned())
                    .await
                    .ok()
                    .and_then(Result::ok)
            }
            Err(_) => None,
        };
        let Some(slot) = slot else {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            if let Some(suppressed) = warn.check("full", Instant::now()) {
                tracing::warn!(
                    max_connections = config.max_connections,
                    suppressed,
                    "admin endpoint busy; closing a connection"
                );
            }
            drop(stream);
            continue;
        };
        let (config, routes, counters, cancel, evictable) = (
            config.clone(),
            routes.clone(),
            counters.clone(),
            cancel.clone(),
            evictable.clone(),
        );
        connections.spawn(async move {
            let _slot = slot;
            connection(stream, &config, &routes, &counters, &cancel, &evictable).await;
        });
    }
    connections.close();
    connections.wait().await;
}

/// One connection: its request within `request_timeout` (evictable until its head is
/// read), then a lingering close (evictable).
async fn connection(
    mut stream: TcpStream,
    config: &AdminConfig,
    routes: &Routes,
    counters: &Counters,
    cancel: &CancellationToken,
    evictable: &Evictable,
) {
    let evict = CancellationToken::new();
    let mut buf = vec![0u8; config.max_request_bytes];
    let id = evictable.add(&evict);
    let on_head = || evictable.remove(id);
    let answered = tokio::select! {
        () = cancel.cancelled() => false,
        () = evict.cancelled() => false,
        r = tokio::time::timeout(
            config.request_timeout,
            answer(&mut stream, &mut buf, routes, counters, on_head),
        ) => r.unwrap_or_else(|_| {
            counters.timeouts.fetch_add(1, Ordering::Relaxed);
            false
        }),
    };
    evictable.remove(id);
    if !answered {
        return;
    }
    // A lingering close: what the client still sends (a body, the rest of a head
    // that was too large) is read and dropped, a bounded amount for a bounded time,
    // so that closing does not reset the connection before the client read its
    // answer.
    let id = evictable.add(&evict);
    let linger = async {
        let mut drained = 0;
        while drained < LINGER_BYTES {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => drained += n,
            }
        }
    };
    tokio::select! {
        () = cancel.cancelled() => {}
        () = evict.cancelled() => {}
        _ = tokio::time::timeout(LINGER_TIME, linger) => {}
    }
    evictable.remove(id);
}

/// Reads one request head into `buf` (calling `on_head` once it is complete) and
/// writes its answer; `true` once answered and shut down for writing.
async fn answer(
    stream: &mut TcpStream,
    buf: &mut [u8],
    routes: &Routes,
    counters: &Counters,
    on_head: impl FnOnce(),
) -> bool {
    let max = buf.len();
    let mut len = 0;
    let parsed = loop {
        let Some(free) = buf.get_mut(len..).filter(|f| !f.is_empty()) else {
            break Err(http::Refused::TooLarge);
        };
        match stream.read(free).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => len += n,
        }
        match http::parse_head(buf.get(..len).unwrap_or_default(), max) {
            Ok(None) => {}
            Ok(Some(head)) => break Ok(head),
            Err(refused) => break Err(refused),
        }
    };
    on_head();
    let response = match parsed {
        Err(refused) => {
            counters.bad.fetch_add(1, Ordering::Relaxed);
            match refused {
                http::Refused::TooLarge => http::text(431, "request head too large\n", false),
                http::Refused::Malformed => http::text(400, "bad request\n", false),
            }
        }
        Ok(head) => route(&head, routes),
    };
    counters.requests.fetch_add(1, Ordering::Relaxed);
    stream.write_all(&response).await.is_ok() && stream.shutdown().await.is_ok()
}

fn route(head: &http::Head<'_>, routes: &Routes) -> Vec<u8> {
    if head.other_method {
        return http::response(
            405,
            "text/plain; charset=utf-8",
            b"GET or HEAD only\n",
            false,
            "allow: GET, HEAD\r\n",
        );
    }
    let head_only = head.head_only;
    match head.path {
        "/livez" => http::text(200, "ok\n", head_only),
        "/readyz" => match (routes.ready)() {
            Ok(()) => http::text(200, "ok\n", head_only),
            Err(reason) => http::text(503, &format!("not ready: {reason}\n"), head_only),
        },
        "/metrics" => match &routes.metrics {
            // A HEAD is not worth a render: no body, so no length either.
            Some(_) if head_only => {
                http::response_without_length(200, "text/plain; version=0.0.4; charset=utf-8")
            }
            Some(render) => http::response(
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                render().as_bytes(),
                head_only,
                "",
            ),
            None => http::text(404, "no metrics here\n", head_only),
        },
        _ => http::text(404, "not found: /metrics, /readyz or /livez\n", head_only),
    }
}

#[cfg(test)]
mod tests;
