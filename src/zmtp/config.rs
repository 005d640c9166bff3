//! Bounds and timers of a ZMTP connection.

use std::time::Duration;

use crate::ConfigError;

/// Largest heartbeat TTL we advertise: 655 deciseconds (libzmq wraps larger values,
/// libzmq#4226).
pub(crate) const MAX_HEARTBEAT_TTL: Duration = Duration::from_millis(65_500);

/// Smallest heartbeat TTL: one decisecond (ZMTP's unit; 0 means "no TTL").
const MIN_HEARTBEAT_TTL: Duration = Duration::from_millis(100);

/// The largest `max_message_size` accepted (4 GiB): keeps every size computation far
/// from overflow.
const MAX_MESSAGE_SIZE_LIMIT: u64 = 1 << 32;

/// Bounds and timers shared by [`SubSocket`](crate::zmtp::SubSocket),
/// [`PubSocket`](crate::zmtp::PubSocket) and [`Session`](crate::zmtp::Session).
///
/// Built with [`Config::builder`]; every value is validated once, in
/// [`ConfigBuilder::build`]. With the defaults, what one peer can make us hold is: the
/// message being assembled (at most `max_message_size`, allocated as its bytes arrive,
/// never as declared) or a 64 KiB read buffer; for a publisher, `send_queue_bytes` of
/// pending output toward it (queue, unwritten output and control together); for a
/// subscriber, read buffers its delivered messages keep alive, copied out past
/// `max_retained_bytes`.
///
/// ```
/// use std::time::Duration;
/// use eventplane::zmtp::Config;
///
/// let config = Config::builder()
///     .max_frame_size(1 << 20)
///     .heartbeat_interval(Some(Duration::from_secs(1)))
///     .build()?;
/// assert_eq!(config.max_frame_size(), 1 << 20);
/// assert_eq!(config.heartbeat_timeout(), Some(Duration::from_secs(1)));
/// # Ok::<(), eventplane::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Config {
    pub(crate) max_frame_size: usize,
    pub(crate) max_message_size: usize,
    pub(crate) max_message_parts: usize,
    pub(crate) max_metadata_size: usize,
    pub(crate) handshake_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) heartbeat_interval: Option<Duration>,
    pub(crate) heartbeat_timeout: Option<Duration>,
    pub(crate) heartbeat_ttl: Option<Duration>,
    pub(crate) strict: bool,
    pub(crate) read_chunk: usize,
    pub(crate) send_queue_messages: usize,
    pub(crate) send_queue_bytes: usize,
    pub(crate) max_subscriptions: usize,
    pub(crate) max_subscription_size: usize,
    pub(crate) write_stall_timeout: Option<Duration>,
    pub(crate) max_connections: usize,
    pub(crate) max_retained_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_frame_size: 8 << 20,
            max_message_size: 16 << 20,
            max_message_parts: 64,
            max_metadata_size: 64 << 10,
            handshake_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            heartbeat_interval: None,
            heartbeat_timeout: None,
            heartbeat_ttl: None,
            strict: false,
            read_chunk: 64 << 10,
            send_queue_messages: 10_000,
            send_queue_bytes: 16 << 20,
            max_subscriptions: 4096,
            max_subscription_size: 1024,
            write_stall_timeout: Some(Duration::from_secs(30)),
            max_connections: 1024,
            max_retained_bytes: 8 << 20,
        }
    }
}

impl Config {
    /// A builder starting from the defaults.
    pub fn builder() -> ConfigBuilder {
        ConfigBuilder {
            config: Config::default(),
        }
    }

    /// Largest frame accepted. Default 8 MiB.
    pub fn max_frame_size(&self) -> usize {
        self.max_frame_size
    }
    /// Largest message (sum of its frames) accepted. Default 16 MiB.
    pub fn max_message_size(&self) -> usize {
        self.max_message_size
    }
    /// Most frames in one message. Default 64.
    pub fn max_message_parts(&self) -> usize {
        self.max_message_parts
    }
    /// Largest READY command (its metadata). Default 64 KiB.
    pub fn max_metadata_size(&self) -> usize {
        self.max_metadata_size
    }
    /// Deadline for greeting + READY. Default 10 s.
    pub fn handshake_timeout(&self) -> Duration {
        self.handshake_timeout
    }
    /// Deadline for a TCP connect. Default 5 s.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }
    /// Interval between our PINGs (sent only to ZMTP 3.1 peers). Default off.
    pub fn heartbeat_interval(&self) -> Option<Duration> {
        self.heartbeat_interval
    }
    /// How long after a PING the peer may stay silent. Default: the interval.
    pub fn heartbeat_timeout(&self) -> Option<Duration> {
        self.heartbeat_timeout.or(self.heartbeat_interval)
    }
    /// TTL advertised in our PINGs. Default 3 × the interval, kept within 100 ms
    /// (ZMTP counts deciseconds; 0 would mean "no TTL") and 65.5 s.
    pub fn heartbeat_ttl(&self) -> Option<Duration> {
        self.heartbeat_ttl.or(self.heartbeat_interval.map(|i| {
            i.saturating_mul(3)
                .clamp(MIN_HEARTBEAT_TTL, MAX_HEARTBEAT_TTL)
        }))
    }
    /// Whether reserved frame-flag bits are a protocol error. Default `false`
    /// (libzmq ignores them too).
    pub fn strict(&self) -> bool {
        self.strict
    }
    /// Size of one socket read. Default 64 KiB.
    pub fn read_chunk(&self) -> usize {
        self.read_chunk
    }
    /// Publisher: messages queued per subscriber before dropping. Default 10 000.
    pub fn send_queue_messages(&self) -> usize {
        self.send_queue_messages
    }
    /// Bytes pending toward one peer, all counted together: queued messages (charged
    /// for the encoding buffers they keep alive), the write buffer and control replies.
    /// A publisher drops a message for a subscriber rather than exceed it. Default
    /// 16 MiB.
    pub fn send_queue_bytes(&self) -> usize {
        self.send_queue_bytes
    }
    /// How long a connection may have output waiting while the peer reads none of it
    /// before it is closed ([`TimeoutKind::WriteStall`](crate::zmtp::TimeoutKind)).
    /// Default 30 s; `None` waits forever.
    pub fn write_stall_timeout(&self) -> Option<Duration> {
        self.write_stall_timeout
    }
    /// Publisher: most connections served at once (handshaking ones included); more
    /// are closed on accept and counted in `PubStats::refused`. Default 1024.
    pub fn max_connections(&self) -> usize {
        self.max_connections
    }
    /// Subscriber: read-buffer memory that received messages may keep alive before
    /// messages are copied out instead of sliced (see
    /// [`SubSocket`](crate::zmtp::SubSocket#memory)), and the read buffers connections
    /// sharing one account may hold at once. Default 8 MiB.
    pub fn max_retained_bytes(&self) -> usize {
        self.max_retained_bytes
    }
    /// Publisher: distinct subscriptions one peer may hold. Default 4096.
    pub fn max_subscriptions(&self) -> usize {
        self.max_subscriptions
    }
    /// Publisher: longest subscription prefix. Default 1 KiB.
    pub fn max_subscription_size(&self) -> usize {
        self.max_subscription_size
    }
}

/// Builds a validated [`Config`]. Every setter names its default.
///
/// ```
/// use eventplane::ConfigError;
/// use eventplane::zmtp::Config;
/// let err = Config::builder().send_queue_messages(0).build().unwrap_err();
/// assert_eq!(err, ConfigError::Zero { field: "send_queue_messages" });
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct ConfigBuilder {
    config: Config,
}

impl ConfigBuilder {
    /// Largest frame accepted; a larger header closes the connection before any
    /// allocation. Default 8 MiB. Must be ≥ 1 and ≤ `max_message_size`.
    pub fn max_frame_size(mut self, bytes: usize) -> Self {
        self.config.max_frame_size = bytes;
        self
    }
    /// Largest message (sum of frames). Default 16 MiB, at most 4 GiB. Costs up to
    /// this much memory per connection while a message is being assembled.
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.config.max_message_size = bytes;
        self
    }
    /// Most frames in one message. Default 64. Must be ≥ 1.
    pub fn max_message_parts(mut self, parts: usize) -> Self {
        self.config.max_message_parts = parts;
        self
    }
    /// Largest READY command. Default 64 KiB. Must be ≥ 64.
    pub fn max_metadata_size(mut self, bytes: usize) -> Self {
        self.config.max_metadata_size = bytes;
        self
    }
    /// Deadline for greeting + READY. Default 10 s. Must be non-zero.
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.config.handshake_timeout = timeout;
        self
    }
    /// Deadline for a TCP connect. Default 5 s. Must be non-zero.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.config.connect_timeout = timeout;
        self
    }
    /// Send a PING this often to ZMTP 3.1 peers. Default `None` (off).
    pub fn heartbeat_interval(mut self, interval: Option<Duration>) -> Self {
        self.config.heartbeat_interval = interval;
        self
    }
    /// Close the connection when nothing arrives this long after a PING. Default: the
    /// interval. Only with an interval.
    pub fn heartbeat_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.config.heartbeat_timeout = timeout;
        self
    }
    /// TTL we advertise in PINGs. Default 3 × interval (kept within 100 ms and
    /// 65.5 s). Set, it must lie within 100 ms ..= 65.5 s; only with an interval.
    pub fn heartbeat_ttl(mut self, ttl: Option<Duration>) -> Self {
        self.config.heartbeat_ttl = ttl;
        self
    }
    /// Treat reserved frame-flag bits as a protocol error. Default `false`.
    pub fn strict(mut self, strict: bool) -> Self {
        self.config.strict = strict;
        self
    }
    /// Size of one socket read. Default 64 KiB. Between 512 B and 16 MiB.
    pub fn read_chunk(mut self, bytes: usize) -> Self {
        self.config.read_chunk = bytes;
        self
    }
    /// Publisher: per-subscriber queue length in messages. Default 10 000. Must be ≥ 1.
    pub fn send_queue_messages(mut self, messages: usize) -> Self {
        self.config.send_queue_messages = messages;
        self
    }
    /// Bytes pending toward one peer: its message queue and its unwritten output
    /// (each charged for the 64 KiB chunks of encoded messages it keeps alive) and
    /// control replies together. Default 16 MiB. Must be ≥ 1. Below 1 MiB every
    /// message gets an allocation of its own, charged its length.
    pub fn send_queue_bytes(mut self, bytes: usize) -> Self {
        self.config.send_queue_bytes = bytes;
        self
    }
    /// Close a connection whose peer reads none of our pending output for this long.
    /// Default 30 s; `None` never closes for that reason. Must be non-zero.
    pub fn write_stall_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.config.write_stall_timeout = timeout;
        self
    }
    /// Publisher: most connections at once; more are refused and counted. Default
    /// 1024. Must be ≥ 1. Each costs a read buffer (`read_chunk`) and its queue.
    pub fn max_connections(mut self, connections: usize) -> Self {
        self.config.max_connections = connections;
        self
    }
    /// Subscriber: read-buffer memory received messages may keep alive before small
    /// frames are copied out. Default 8 MiB. Must be ≥ 1. The same limit bounds the
    /// read buffers that the connections sharing one account (a `DynamicSubscriber`'s)
    /// hold at once: above it, each gives its buffer back after every receive.
    pub fn max_retained_bytes(mut self, bytes: usize) -> Self {
        self.config.max_retained_bytes = bytes;
        self
    }
    /// Publisher: distinct subscriptions one peer may hold. Default 4096. Must be ≥ 1.
    pub fn max_subscriptions(mut self, count: usize) -> Self {
        self.config.max_subscriptions = count;
        self
    }
    /// Publisher: longest subscription prefix accepted. Default 1 KiB. A subscriber's
    /// frames are capped at this + 1 (and at `max_frame_size`).
    pub fn max_subscription_size(mut self, bytes: usize) -> Self {
        self.config.max_subscription_size = bytes;
        self
    }

    /// Validates and returns the config.
    pub fn build(self) -> Result<Config, ConfigError> {
        let c = self.config;
        let nonzero = [
            ("max_frame_size", c.max_frame_size),
            ("max_message_size", c.max_message_size),
            ("max_message_parts", c.max_message_parts),
            ("send_queue_messages", c.send_queue_messages),
            ("send_queue_bytes", c.send_queue_bytes),
            ("max_subscriptions", c.max_subscriptions),
            ("max_connections", c.max_connections),
            ("max_retained_bytes", c.max_retained_bytes),
        ];
        for (field, value) in nonzero {
            if value == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        if c.max_frame_size > c.max_message_size {
            return Err(ConfigError::Inconsistent {
                field: "max_frame_size",
                reason: "exceeds max_message_size",
            });
        }
        if c.max_message_size as u64 > MAX_MESSAGE_SIZE_LIMIT {
            return Err(ConfigError::OutOfRange {
                field: "max_message_size",
                reason: "must be at most 4 GiB",
            });
        }
        if c.max_subscription_size as u64 > MAX_MESSAGE_SIZE_LIMIT {
            return Err(ConfigError::OutOfRange {
                field: "max_subscription_size",
                reason: "must be at most 4 GiB",
            });
        }
        if c.max_metadata_size < 64 {
            return Err(ConfigError::OutOfRange {
                field: "max_metadata_size",
                reason: "must be at least 64 bytes",
            });
        }
        if !(512..=16 << 20).contains(&c.read_chunk) {
            return Err(ConfigError::OutOfRange {
                field: "read_chunk",
                reason: "must be between 512 B and 16 MiB",
            });
        }
        let durations = [
            ("handshake_timeout", Some(c.handshake_timeout)),
            ("connect_timeout", Some(c.connect_timeout)),
            ("heartbeat_interval", c.heartbeat_interval),
            ("heartbeat_timeout", c.heartbeat_timeout),
            ("heartbeat_ttl", c.heartbeat_ttl),
            ("write_stall_timeout", c.write_stall_timeout),
        ];
        for (field, value) in durations {
            if value == Some(Duration::ZERO) {
                return Err(ConfigError::Zero { field });
            }
        }
        if c.heartbeat_ttl
            .is_some_and(|t| !(MIN_HEARTBEAT_TTL..=MAX_HEARTBEAT_TTL).contains(&t))
        {
            return Err(ConfigError::OutOfRange {
                field: "heartbeat_ttl",
                reason: "must lie within 100 ms ..= 65.5 s (1 ..= 655 deciseconds)",
            });
        }
        if c.heartbeat_interval.is_none() {
            for (field, value) in [
                ("heartbeat_timeout", c.heartbeat_timeout),
                ("heartbeat_ttl", c.heartbeat_ttl),
            ] {
                if value.is_some() {
                    return Err(ConfigError::Inconsistent {
                        field,
                        reason: "is set without a heartbeat_interval (no PING is sent)",
                    });
                }
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_design() {
        let c = Config::default();
        assert_eq!(c.max_frame_size(), 8 << 20);
        assert_eq!(c.max_message_size(), 16 << 20);
        assert_eq!(c.max_message_parts(), 64);
        assert_eq!(c.handshake_timeout(), Duration::from_secs(10));
        assert_eq!(c.heartbeat_interval(), None);
        assert_eq!(c.send_queue_messages(), 10_000);
        assert_eq!(c.send_queue_bytes(), 16 << 20);
        assert_eq!(c.write_stall_timeout(), Some(Duration::from_secs(30)));
        assert_eq!(c.max_connections(), 1024);
        assert_eq!(c.max_retained_bytes(), 8 << 20);
    }

    #[test]
    fn rejects_bad_values() {
        assert_eq!(
            Config::builder().max_message_parts(0).build().unwrap_err(),
            ConfigError::Zero {
                field: "max_message_parts"
            }
        );
        assert!(Config::builder().max_frame_size(32 << 20).build().is_err());
        let hb = || Config::builder().heartbeat_interval(Some(Duration::from_secs(1)));
        for ttl in [Duration::from_secs(70), Duration::from_millis(99)] {
            let err = hb().heartbeat_ttl(Some(ttl)).build().unwrap_err();
            assert_eq!(err.field(), "heartbeat_ttl");
        }
        assert!(
            hb().heartbeat_ttl(Some(Duration::from_millis(100)))
                .build()
                .is_ok()
        );
        // Without an interval no PING is sent: a timeout or TTL would be ignored.
        for config in [
            Config::builder().heartbeat_timeout(Some(Duration::from_secs(1))),
            Config::builder().heartbeat_ttl(Some(Duration::from_secs(1))),
        ] {
            assert!(matches!(
                config.build(),
                Err(ConfigError::Inconsistent { .. })
            ));
        }
    }

    #[test]
    fn heartbeat_derived_defaults() {
        let c = Config::builder()
            .heartbeat_interval(Some(Duration::from_secs(30)))
            .build()
            .unwrap();
        assert_eq!(c.heartbeat_timeout(), Some(Duration::from_secs(30)));
        assert_eq!(c.heartbeat_ttl(), Some(MAX_HEARTBEAT_TTL));
        // A short interval still advertises a TTL (0 deciseconds would mean none).
        let c = Config::builder()
            .heartbeat_interval(Some(Duration::from_millis(20)))
            .build()
            .unwrap();
        assert_eq!(c.heartbeat_ttl(), Some(Duration::from_millis(100)));
    }
}
