//! A broker's (and a source's) per-stage deadlines.

use std::time::Duration;

use crate::tunnel::error::TunnelError;

/// Default deadline for resolving a target's host.
pub(crate) const DNS_TIMEOUT: Duration = Duration::from_secs(5);
/// Default deadline for connecting to a target, across all its resolved addresses.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default cap on one connection attempt (one resolved address).
pub(crate) const CONNECT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default deadline for obtaining an HTTP/2 stream slot for a data stream.
pub(crate) const STREAM_SLOT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default deadline for the router's response head on a session or data stream.
pub(crate) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default deadline for reaching the bus (TCP, then TLS, each).
pub(crate) const BUS_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A broker's per-stage deadlines (DESIGN §7.2). A stage that misses its deadline is
/// refused with its own code (`dns_timeout`, `connect_timeout`,
/// `stream_slot_timeout`, `response_timeout`) and releases what it held.
///
/// ```
/// use std::time::Duration;
/// use eventplane::tunnel::Deadlines;
/// let deadlines = Deadlines::default().connect(Duration::from_secs(3));
/// assert!(deadlines.validate().is_ok());
/// assert!(deadlines.dns(Duration::ZERO).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Deadlines {
    pub(crate) dns: Duration,
    pub(crate) connect: Duration,
    pub(crate) connect_attempt: Duration,
    pub(crate) stream_slot: Duration,
    pub(crate) response: Duration,
    pub(crate) bus_connect: Duration,
}

/// Settings: each setter documents its default.
impl Deadlines {
    /// The longest a session takes to start: TCP, then TLS (each within
    /// [`bus_connect`](Self::bus_connect)), then the bus's answer
    /// ([`response`](Self::response)).
    ///
    /// ```
    /// use std::time::Duration;
    /// use eventplane::tunnel::Deadlines;
    /// let d = Deadlines::default().bus_connect(Duration::from_secs(2)).response(Duration::from_secs(3));
    /// assert_eq!(d.session_start(), Duration::from_secs(7));
    /// ```
    pub fn session_start(&self) -> Duration {
        self.bus_connect * 2 + self.response
    }

    /// Resolving a target's host (default 5 s).
    #[must_use]
    pub fn dns(mut self, dns: Duration) -> Self {
        self.dns = dns;
        self
    }

    /// Connecting to a target, all resolved addresses together (default 10 s).
    #[must_use]
    pub fn connect(mut self, connect: Duration) -> Self {
        self.connect = connect;
        self
    }

    /// One connection attempt to one resolved address (default 5 s).
    #[must_use]
    pub fn connect_attempt(mut self, connect_attempt: Duration) -> Self {
        self.connect_attempt = connect_attempt;
        self
    }

    /// A data stream getting its HTTP/2 stream slot: a permit under the welcome's
    /// stream limit, and hyper taking the request (it waits while the bus's
    /// concurrency limit is reached) (default 5 s).
    #[must_use]
    pub fn stream_slot(mut self, stream_slot: Duration) -> Self {
        self.stream_slot = stream_slot;
        self
    }

    /// The router's response head, on the session and on each data stream (default
    /// 10 s).
    #[must_use]
    pub fn response(mut self, response: Duration) -> Self {
        self.response = response;
        self
    }

    /// Reaching the bus: the TCP connect, then the TLS handshake (default 10 s each).
    #[must_use]
    pub fn bus_connect(mut self, bus_connect: Duration) -> Self {
        self.bus_connect = bus_connect;
        self
    }
}

impl Default for Deadlines {
    fn default() -> Deadlines {
        Deadlines {
            dns: DNS_TIMEOUT,
            connect: CONNECT_TIMEOUT,
            connect_attempt: CONNECT_ATTEMPT_TIMEOUT,
            stream_slot: STREAM_SLOT_TIMEOUT,
            response: RESPONSE_TIMEOUT,
            bus_connect: BUS_CONNECT_TIMEOUT,
        }
    }
}

impl Deadlines {
    /// The first deadline that is zero or over an hour ([`TunnelError::Config`] names
    /// it).
    pub fn validate(&self) -> Result<(), TunnelError> {
        for (field, value) in [
            ("deadlines.dns", self.dns),
            ("deadlines.connect", self.connect),
            ("deadlines.connect_attempt", self.connect_attempt),
            ("deadlines.stream_slot", self.stream_slot),
            ("deadlines.response", self.response),
            ("deadlines.bus_connect", self.bus_connect),
        ] {
            if value.is_zero() || value > Duration::from_secs(3600) {
                return Err(TunnelError::Config {
                    field,
                    reason: format!("{value:?} is not within 1 ns..=1 h"),
                });
            }
        }
        Ok(())
    }
}
