//! What a broker is told: where the bus is, who it is, what it covers and may dial,
//! its per-stage deadlines, buffer sizes and reconnect backoff (DESIGN §7.2); and what
//! the router's bus is told: the limits it offers, its connection cap and the
//! deadlines it holds connections to (DESIGN §7.3).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::BoxFuture;
use crate::discovery::Discovery;
use crate::net::AddrFilter;
pub use crate::tunnel::deadlines::Deadlines;
use crate::tunnel::error::TunnelError;
use crate::tunnel::io::Secret;
use crate::tunnel::{
    Limits, MAX_SESSION_BUFFER_BYTES, MAX_STREAM_BUFFER_BYTES, MIN_STREAM_BUFFER_BYTES,
};

/// Default cap on a broker's DNS lookups in flight.
pub(crate) const MAX_DNS_LOOKUPS: usize = 32;

/// Default rate at which a broker opens streams, per session (a burst of up to the
/// session's stream limit passes at once).
pub(crate) const OPENS_PER_SECOND: u32 = 500;

/// How a broker resolves a target's host: the system resolver by default
/// ([`SystemResolver`]); a cluster may plug in its own.
///
/// ```
/// use std::net::SocketAddr;
/// use eventplane::BoxFuture;
/// use eventplane::tunnel::Resolver;
/// /// Every name is one fixed address.
/// struct Fixed(SocketAddr);
/// impl Resolver for Fixed {
///     fn resolve(&self, _host: &str, _port: u16) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
///         let addr = self.0;
///         Box::pin(async move { Ok(vec![addr]) })
///     }
/// }
/// ```
pub trait Resolver: Send + Sync + 'static {
    /// The addresses of `host` at `port` (an empty list reads as a DNS failure).
    fn resolve(
        &self,
        host: &str,
        port: u16,
    ) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>>;
}

/// The system resolver (`getaddrinfo` on a blocking thread, through Tokio).
///
/// ```
/// # #[tokio::main] async fn main() -> std::io::Result<()> {
/// use eventplane::tunnel::{Resolver, SystemResolver};
/// let addrs = SystemResolver.resolve("127.0.0.1", 80).await?;
/// assert_eq!(addrs[0].port(), 80);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolver for SystemResolver {
    fn resolve(
        &self,
        host: &str,
        port: u16,
    ) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
        let host = host.to_owned();
        Box::pin(async move {
            Ok(tokio::net::lookup_host((host.as_str(), port))
                .await?
                .collect())
        })
    }
}

/// What a broker needs: where the bus is, who it is, what it covers, what it may dial,
/// and its deadlines, buffers and backoff.
///
/// ```no_run
/// # fn main() -> Result<(), eventplane::tunnel::TunnelError> {
/// use std::sync::Arc;
/// use std::time::Duration;
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::tunnel::{BrokerConfig, Deadlines, Secret, client_tls};
/// let config = BrokerConfig::new(
///     "https://router.example:8443",
///     "broker-a",
///     vec!["prod".to_owned()],
///     Secret::from_file("/etc/eventplane/bus.token")?,
///     client_tls("/etc/eventplane/bus-ca.pem")?,
///     Arc::new(MemoryDiscovery::new()),
/// )
/// .drain_deadline(Duration::from_secs(10))
/// .deadlines(Deadlines::default().dns(Duration::from_secs(2)));
/// config.validate()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct BrokerConfig {
    pub(crate) bus_url: String,
    pub(crate) client_id: String,
    pub(crate) namespaces: Vec<String>,
    pub(crate) token: Secret,
    pub(crate) tls: Arc<rustls::ClientConfig>,
    pub(crate) discovery: Arc<dyn Discovery>,
    pub(crate) addr_filter: AddrFilter,
    pub(crate) drain_deadline: Duration,
    pub(crate) deadlines: Deadlines,
    pub(crate) max_stream_buffer_bytes: usize,
    pub(crate) max_session_buffer_bytes: usize,
    pub(crate) reconnect_min: Duration,
    pub(crate) reconnect_max: Duration,
    pub(crate) resolver: Arc<dyn Resolver>,
    pub(crate) max_dns_lookups: usize,
    pub(crate) opens_per_second: u32,
}

/// Settings: each setter documents its default.
impl BrokerConfig {
    /// The router's bus, `https://host:port` (plaintext is refused). Required: `new` sets it; this replaces it.
    #[must_use]
    pub fn bus_url(mut self, bus_url: impl Into<String>) -> Self {
        self.bus_url = bus_url.into();
        self
    }

    /// This broker's id (one session per id: a new one supersedes the old). Required: `new` sets it; this replaces it.
    #[must_use]
    pub fn client_id(mut self, client_id: impl Into<String>) -> Self {
        self.client_id = client_id.into();
        self
    }

    /// The discovery namespaces it serves. Required: `new` sets it; this replaces it.
    #[must_use]
    pub fn namespaces(mut self, namespaces: Vec<String>) -> Self {
        self.namespaces = namespaces;
        self
    }

    /// The bearer credential. Required: `new` sets it; this replaces it.
    #[must_use]
    pub fn token(mut self, token: Secret) -> Self {
        self.token = token;
        self
    }

    /// TLS for the bus (see [`client_tls`](crate::tunnel::client_tls)). Required: `new` sets it; this replaces it.
    #[must_use]
    pub fn tls(mut self, tls: Arc<rustls::ClientConfig>) -> Self {
        self.tls = tls;
        self
    }

    /// Its own view of the publishers: only endpoints advertised here are dialled. The
    /// broker watches each namespace and does not dial the bus before every initial
    /// list is complete. Required: `new` sets it; this replaces it.
    #[must_use]
    pub fn discovery(mut self, discovery: Arc<dyn Discovery>) -> Self {
        self.discovery = discovery;
        self
    }

    /// The per-stage deadlines. Default [`Deadlines::default`] (each stated on its
    /// setter).
    #[must_use]
    pub fn deadlines(mut self, deadlines: Deadlines) -> Self {
        self.deadlines = deadlines;
        self
    }

    /// Bytes one stream may queue toward the router, 64 B per chunk included (default
    /// and most 1 MiB, least 16 KiB; the welcome may lower it).
    #[must_use]
    pub fn max_stream_buffer_bytes(mut self, max_stream_buffer_bytes: usize) -> Self {
        self.max_stream_buffer_bytes = max_stream_buffer_bytes;
        self
    }

    /// Bytes all streams of a session may queue toward the router (default and most
    /// 64 MiB; at least the stream buffer).
    #[must_use]
    pub fn max_session_buffer_bytes(mut self, max_session_buffer_bytes: usize) -> Self {
        self.max_session_buffer_bytes = max_session_buffer_bytes;
        self
    }

    /// The shortest reconnect delay (default 1 s): every wait is at least this, jittered
    /// up to a ceiling that starts at twice it and doubles up to `reconnect_max`
    /// (default 60 s; see [`Backoff`](crate::net::Backoff)).
    #[must_use]
    pub fn reconnect_min(mut self, reconnect_min: Duration) -> Self {
        self.reconnect_min = reconnect_min;
        self
    }

    /// The longest reconnect delay (default 60 s).
    #[must_use]
    pub fn reconnect_max(mut self, reconnect_max: Duration) -> Self {
        self.reconnect_max = reconnect_max;
        self
    }

    /// DNS lookups in flight at once (default 32; 1 to 4,096).
    /// A lookup keeps its slot until it ends, even after its stream gave up; one past
    /// the cap waits within the DNS deadline (counted in `dns_saturated`).
    #[must_use]
    pub fn max_dns_lookups(mut self, max_dns_lookups: usize) -> Self {
        self.max_dns_lookups = max_dns_lookups;
        self
    }

    /// Streams opened per second and session, after a burst of the session's stream
    /// limit (default 500; 1 to 1,000,000); subscribes past it
    /// are refused with `rate_limited`, so a router cannot make the broker churn
    /// connections to publishers.
    #[must_use]
    pub fn opens_per_second(mut self, opens_per_second: u32) -> Self {
        self.opens_per_second = opens_per_second;
        self
    }
}

impl std::fmt::Debug for BrokerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerConfig")
            .field("bus_url", &self.bus_url)
            .field("client_id", &self.client_id)
            .field("namespaces", &self.namespaces)
            .field("token", &self.token)
            .field("deadlines", &self.deadlines)
            .field("max_stream_buffer_bytes", &self.max_stream_buffer_bytes)
            .field("max_session_buffer_bytes", &self.max_session_buffer_bytes)
            .finish_non_exhaustive()
    }
}

impl BrokerConfig {
    /// A configuration with the strict address filter ([`AddrFilter::strict`]: no
    /// loopback), the default deadlines, buffers and backoff, and a 30 s drain
    /// deadline.
    pub fn new(
        bus_url: impl Into<String>,
        client_id: impl Into<String>,
        namespaces: Vec<String>,
        token: Secret,
        tls: Arc<rustls::ClientConfig>,
        discovery: Arc<dyn Discovery>,
    ) -> BrokerConfig {
        BrokerConfig {
            bus_url: bus_url.into(),
            client_id: client_id.into(),
            namespaces,
            token,
            tls,
            discovery,
            addr_filter: AddrFilter::strict(),
            drain_deadline: Duration::from_secs(30),
            deadlines: Deadlines::default(),
            max_stream_buffer_bytes: MAX_STREAM_BUFFER_BYTES,
            max_session_buffer_bytes: MAX_SESSION_BUFFER_BYTES,
            reconnect_min: Duration::from_secs(1),
            reconnect_max: Duration::from_secs(60),
            resolver: Arc::new(SystemResolver),
            max_dns_lookups: MAX_DNS_LOOKUPS,
            opens_per_second: OPENS_PER_SECOND,
        }
    }

    /// With open streams allowed `deadline` to finish when draining (default 30 s).
    #[must_use]
    pub fn drain_deadline(mut self, deadline: Duration) -> BrokerConfig {
        self.drain_deadline = deadline;
        self
    }

    /// Which resolved addresses may be dialled. Default [`AddrFilter::strict`]:
    /// loopback, link-local, metadata and the other special ranges refused, NAT64 and
    /// 6to4 forms of them too; reopen a range with a CIDR inside it (e.g.
    /// `127.0.0.0/8`).
    #[must_use]
    pub fn addr_filter(mut self, filter: AddrFilter) -> BrokerConfig {
        self.addr_filter = filter;
        self
    }

    /// How target hosts are resolved. Default [`SystemResolver`] (the system's
    /// resolver on a blocking thread).
    #[must_use]
    pub fn resolver(mut self, resolver: Arc<dyn Resolver>) -> BrokerConfig {
        self.resolver = resolver;
        self
    }

    /// The first refused setting, if any.
    pub fn validate(&self) -> Result<(), TunnelError> {
        let refuse =
            |field: &'static str, reason: String| Err(TunnelError::Config { field, reason });
        check_client(&self.bus_url, &self.client_id, &self.namespaces, &[])?;
        self.deadlines.validate()?;
        if self.drain_deadline > Duration::from_secs(3600) {
            return refuse("drain_deadline", "is over an hour".into());
        }
        if !(MIN_STREAM_BUFFER_BYTES..=MAX_STREAM_BUFFER_BYTES)
            .contains(&self.max_stream_buffer_bytes)
        {
            return refuse(
                "max_stream_buffer_bytes",
                format!(
                    "{} is not within {MIN_STREAM_BUFFER_BYTES}..={MAX_STREAM_BUFFER_BYTES}",
                    self.max_stream_buffer_bytes
                ),
            );
        }
        if !(self.max_stream_buffer_bytes..=MAX_SESSION_BUFFER_BYTES)
            .contains(&self.max_session_buffer_bytes)
        {
            return refuse(
                "max_session_buffer_bytes",
                format!(
                    "{} is not within max_stream_buffer_bytes..={MAX_SESSION_BUFFER_BYTES}",
                    self.max_session_buffer_bytes
                ),
            );
        }
        if !(1..=4096).contains(&self.max_dns_lookups) {
            return refuse(
                "max_dns_lookups",
                format!("{} is not within 1..=4096", self.max_dns_lookups),
            );
        }
        if !(1..=1_000_000).contains(&self.opens_per_second) {
            return refuse(
                "opens_per_second",
                format!("{} is not within 1..=1000000", self.opens_per_second),
            );
        }
        crate::net::Backoff::new(self.reconnect_min, self.reconnect_max).map_err(|e| {
            TunnelError::Config {
                field: "reconnect",
                reason: e.to_string(),
            }
        })?;
        Ok(())
    }
}

/// Default cap on the authenticated connections an [`EventBus`](crate::tunnel::EventBus)
/// holds at once (brokers need one each).
pub(crate) const MAX_CONNECTIONS: usize = 1024;

/// Default cap on the authenticated connections one credential holds at once (a
/// broker needs one; a reconnect or `--check-bus` briefly a second).
pub(crate) const MAX_CONNECTIONS_PER_CLIENT: usize = 4;

/// Default cap on the connections an [`EventBus`](crate::tunnel::EventBus) holds before they
/// authenticate (their own pool: a flood of them cannot take a broker's slot).
pub(crate) const MAX_PENDING_CONNECTIONS: usize = 64;

/// Default cap on the unauthenticated connections from one source address.
pub(crate) const MAX_PENDING_PER_SOURCE: usize = 8;

/// Default deadline for a broker connection's TLS handshake at the bus.
pub(crate) const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// Default time a connection may take, after TLS, to send its first request with a
/// credential the bus accepts.
pub(crate) const AUTH_TIMEOUT: Duration = Duration::from_secs(3);

/// Default time a connection may take, after TLS, to have a session welcomed (the
/// right credential and a valid `hello`).
pub(crate) const SESSION_START_TIMEOUT: Duration = Duration::from_secs(10);

/// Default time a joining broker's session must live before it takes its share of
/// the open streams: a broker that flaps moves nothing.
pub(crate) const JOIN_HOLD_DOWN: Duration = Duration::from_secs(10);

/// What the router's [`EventBus`](crate::tunnel::EventBus) offers brokers and holds them to.
///
/// ```
/// use std::time::Duration;
/// use eventplane::tunnel::{EventBusConfig, Limits};
/// let config = EventBusConfig::default()
///     .limits(Limits::default().with_max_streams(256))
///     .join_hold_down(Duration::from_secs(30));
/// assert!(config.validate().is_ok());
/// assert!(config.max_connections(0).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct EventBusConfig {
    pub(crate) limits: Limits,
    pub(crate) max_connections: usize,
    pub(crate) max_connections_per_client: usize,
    pub(crate) max_pending_connections: usize,
    pub(crate) max_pending_per_source: usize,
    pub(crate) tls_handshake_timeout: Duration,
    pub(crate) auth_timeout: Duration,
    pub(crate) session_start_timeout: Duration,
    pub(crate) join_hold_down: Duration,
    pub(crate) announced_watch_buffer: usize,
    pub(crate) max_announced_sources: usize,
    pub(crate) announced_channel_hold: Duration,
}

/// Settings: each setter documents its default.
impl EventBusConfig {
    /// Authenticated connections held at once (each carries at most one broker
    /// session); a credential presented past it is answered 503 and the connection
    /// closed, counted in `connections_refused` (default 1,024;
    /// at most 65,536). Each costs a file descriptor and its HTTP/2 buffers.
    #[must_use]
    pub fn max_connections(mut self, max_connections: usize) -> Self {
        self.max_connections = max_connections;
        self
    }

    /// Authenticated connections one credential holds at once; one more is answered
    /// 503 and closed, counted in `connections_refused` (default
    /// 4): a stolen credential cannot take the slots
    /// of every other broker.
    #[must_use]
    pub fn max_connections_per_client(mut self, max_connections_per_client: usize) -> Self {
        self.max_connections_per_client = max_connections_per_client;
        self
    }

    /// Connections held before they authenticate (TLS, then the first request with an
    /// accepted credential), in a pool of their own. When it is full, a new
    /// connection is taken and one is closed, counted in `pending_evicted`: of the
    /// source holding the most, the one that has gone longest without progress
    /// (accepted, first bytes, TLS done) (default 64; at
    /// most 65,536).
    #[must_use]
    pub fn max_pending_connections(mut self, max_pending_connections: usize) -> Self {
        self.max_pending_connections = max_pending_connections;
        self
    }

    /// Unauthenticated connections from one source (an IPv4 address, an IPv6 /64);
    /// one more is taken and that source's connection longest without progress is
    /// closed, counted in `pending_evicted` (default 8): a
    /// broker behind a NAT its flooders share is not refused for their connections.
    #[must_use]
    pub fn max_pending_per_source(mut self, max_pending_per_source: usize) -> Self {
        self.max_pending_per_source = max_pending_per_source;
        self
    }

    /// A connection's TLS handshake, from accept (default 3 s).
    #[must_use]
    pub fn tls_handshake_timeout(mut self, tls_handshake_timeout: Duration) -> Self {
        self.tls_handshake_timeout = tls_handshake_timeout;
        self
    }

    /// The first request with an accepted credential, from the end of TLS (default
    /// 3 s); else the connection is closed.
    #[must_use]
    pub fn auth_timeout(mut self, auth_timeout: Duration) -> Self {
        self.auth_timeout = auth_timeout;
        self
    }

    /// A session welcomed on a connection, from the end of its TLS handshake; else
    /// the connection is closed (default 10 s).
    #[must_use]
    pub fn session_start_timeout(mut self, session_start_timeout: Duration) -> Self {
        self.session_start_timeout = session_start_timeout;
        self
    }

    /// How long a joining broker's session must hold before its rendezvous share of
    /// the open streams moves to it (default 10 s; zero moves at the welcome).
    #[must_use]
    pub fn join_hold_down(mut self, join_hold_down: Duration) -> Self {
        self.join_hold_down = join_hold_down;
        self
    }

    /// Events each watcher of the announced sources ([`EventBus::announced`](crate::tunnel::EventBus::announced))
    /// may have waiting before it is resynced instead (default 4096).
    #[must_use]
    pub fn announced_watch_buffer(mut self, announced_watch_buffer: usize) -> Self {
        self.announced_watch_buffer = announced_watch_buffer;
        self
    }

    /// Most publishers announced on the bus at once, all sources together (default
    /// 16,384; each source session is held to the welcome's `max_sources` too).
    /// Each source credential is sure of an even share of it: one may go past its
    /// share only into room no other credential's share needs.
    #[must_use]
    pub fn max_announced_sources(mut self, max_announced_sources: usize) -> Self {
        self.max_announced_sources = max_announced_sources;
        self
    }

    /// How long an announced channel stays bound to the credential that announced
    /// it after its session ended (default 10 min): another source's credential
    /// announcing it meanwhile is refused `held_by_another_source`, so a source that
    /// reconnects finds its channels its own. Withdrawn (not lost), a channel is free
    /// at once.
    #[must_use]
    pub fn announced_channel_hold(mut self, announced_channel_hold: Duration) -> Self {
        self.announced_channel_hold = announced_channel_hold;
        self
    }
}

impl Default for EventBusConfig {
    fn default() -> EventBusConfig {
        EventBusConfig {
            limits: Limits::default(),
            max_connections: MAX_CONNECTIONS,
            max_connections_per_client: MAX_CONNECTIONS_PER_CLIENT,
            max_pending_connections: MAX_PENDING_CONNECTIONS,
            max_pending_per_source: MAX_PENDING_PER_SOURCE,
            tls_handshake_timeout: TLS_HANDSHAKE_TIMEOUT,
            auth_timeout: AUTH_TIMEOUT,
            session_start_timeout: SESSION_START_TIMEOUT,
            join_hold_down: JOIN_HOLD_DOWN,
            announced_watch_buffer: 4096,
            max_announced_sources: 16_384,
            announced_channel_hold: Duration::from_secs(600),
        }
    }
}

impl EventBusConfig {
    /// The limits offered in every welcome. Default [`Limits::default`]: 1,024
    /// streams, 1 MiB per stream, heartbeat every 10 s, idle timeout 30 s, 1,024
    /// announced sources per session.
    #[must_use]
    pub fn limits(mut self, limits: Limits) -> EventBusConfig {
        self.limits = limits;
        self
    }

    /// The first refused setting, if any ([`TunnelError::Config`] names it).
    pub fn validate(&self) -> Result<(), TunnelError> {
        let refuse =
            |field: &'static str, reason: String| Err(TunnelError::Config { field, reason });
        for (field, value) in [
            ("max_connections", self.max_connections),
            (
                "max_connections_per_client",
                self.max_connections_per_client,
            ),
            ("max_pending_connections", self.max_pending_connections),
            ("max_pending_per_source", self.max_pending_per_source),
            ("announced_watch_buffer", self.announced_watch_buffer),
            ("max_announced_sources", self.max_announced_sources),
        ] {
            if !(1..=65_536).contains(&value) {
                return refuse(field, format!("{value} is not within 1..=65536"));
            }
        }
        for (field, value) in [
            ("tls_handshake_timeout", self.tls_handshake_timeout),
            ("auth_timeout", self.auth_timeout),
            ("session_start_timeout", self.session_start_timeout),
        ] {
            if value.is_zero() || value > Duration::from_secs(3600) {
                return refuse(field, format!("{value:?} is not within 1 ns..=1 h"));
            }
        }
        if self.announced_channel_hold > Duration::from_secs(86_400) {
            return refuse(
                "announced_channel_hold",
                format!("{:?} is over a day", self.announced_channel_hold),
            );
        }
        if self.join_hold_down > Duration::from_secs(3600) {
            return refuse(
                "join_hold_down",
                format!("{:?} is over an hour", self.join_hold_down),
            );
        }
        if self.limits.max_streams == 0 {
            return refuse("limits.max_streams", "is zero".into());
        }
        if self.limits.heartbeat_interval.is_zero()
            || self.limits.idle_timeout <= self.limits.heartbeat_interval
        {
            return refuse(
                "limits.idle_timeout",
                format!(
                    "{:?} must exceed a non-zero heartbeat interval ({:?})",
                    self.limits.idle_timeout, self.limits.heartbeat_interval
                ),
            );
        }
        Ok(())
    }
}

/// `host`, `port` and `authority` of a bus URL (`https://host[:port]`), or why it is
/// refused.
pub(crate) fn parse_bus_url(bus_url: &str) -> Result<(String, u16, String), TunnelError> {
    let bad = |reason: &str| TunnelError::Config {
        field: "bus_url",
        reason: format!("{bus_url:?} {reason}"),
    };
    let rest = bus_url
        .strip_prefix("https://")
        .ok_or_else(|| bad("is not https:// (plaintext is refused)"))?;
    let authority = rest.split('/').next().unwrap_or_default();
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => {
            (h, p.parse::<u16>().map_err(|_| bad("has a bad port"))?)
        }
        _ => (authority, 443),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad("has no host"));
    }
    Ok((host.to_owned(), port, authority.to_owned()))
}

/// What every bus client's config must hold: an `https://` bus URL, a client id and
/// 1 ..= 256 distinct namespaces of 1 ..= 1 KiB, and a `hello` (with `sources`, for a
/// source) that fits one control frame, or every session would fail.
pub(crate) fn check_client(
    bus_url: &str,
    client_id: &str,
    namespaces: &[String],
    sources: &[crate::tunnel::AnnouncedSource],
) -> Result<(), TunnelError> {
    let refuse = |field: &'static str, reason: String| Err(TunnelError::Config { field, reason });
    parse_bus_url(bus_url)?;
    if client_id.is_empty() || client_id.len() > crate::tunnel::MAX_NAME_LEN {
        return refuse("client_id", "is empty or too long".into());
    }
    if namespaces.is_empty() || namespaces.len() > crate::tunnel::MAX_NAMESPACES {
        return refuse(
            "namespaces",
            format!("must name 1 to {}", crate::tunnel::MAX_NAMESPACES),
        );
    }
    let distinct: std::collections::HashSet<&String> = namespaces.iter().collect();
    if distinct.len() != namespaces.len() {
        return refuse("namespaces", "names one twice".into());
    }
    if namespaces
        .iter()
        .any(|n| n.is_empty() || n.len() > crate::tunnel::MAX_NAME_LEN)
    {
        return refuse(
            "namespaces",
            format!("each must be 1 to {} bytes", crate::tunnel::MAX_NAME_LEN),
        );
    }
    let hello = if sources.is_empty() {
        crate::tunnel::Hello::new(client_id, namespaces.to_vec())
    } else {
        crate::tunnel::Hello::source(client_id, namespaces.to_vec(), sources.to_vec())
    };
    let mut wire = Vec::new();
    crate::tunnel::Control::Hello(hello).encode(&mut wire);
    // The 4-byte length prefix is not part of the body the decoder bounds.
    if wire.len() > crate::tunnel::MAX_CONTROL_FRAME + 4 {
        return refuse(
            "namespaces",
            format!(
                "the hello would take {} bytes, over the {}-byte control frame",
                wire.len(),
                crate::tunnel::MAX_CONTROL_FRAME
            ),
        );
    }
    Ok(())
}
