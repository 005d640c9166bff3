//! The builder of `EtcdDiscovery`: every setting with its default.

use std::time::Duration;

use super::EtcdDiscovery;
use super::config::{self, EtcdConfig};
use crate::discovery::{DiscoveryError, DynamoRecords};
use crate::wire::Dialect;

/// Builds an [`EtcdDiscovery`]. Every setter documents its default.
///
/// ```no_run
/// use std::time::Duration;
/// use eventplane::discovery::EtcdDiscovery;
/// # #[tokio::main]
/// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
/// let discovery = EtcdDiscovery::builder(["http://10.0.0.2:2379", "http://10.0.0.3:2379"])
///     .prefix("/prod-eventplane")
///     .lease_ttl(Duration::from_secs(15))
///     .connect()
///     .await?;
/// # let _ = discovery;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct EtcdDiscoveryBuilder {
    pub(super) config: EtcdConfig,
}

impl EtcdDiscoveryBuilder {
    /// Key prefix; keys live under `{prefix}/v1/channels/`. Default
    /// `/eventplane`. Must start with `/` and not end with one.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.prefix = prefix.into();
        self
    }

    /// Whose records to read and write: ours ([`Dialect::EventPlane`], the default)
    /// or Dynamo's ([`Dialect::Dynamo`]: `v1/event_channels/…` with
    /// `v1/event_sources/…` beside each registration, both under the lease, the
    /// prefix not applying), to follow Dynamo workers or to be followed by a Dynamo
    /// router. In Dynamo's, [`records`](Self::records) says which endpoint and worker;
    /// without it every endpoint is followed and registering is refused.
    ///
    /// ```no_run
    /// use eventplane::discovery::{DynamoRecords, EtcdDiscovery};
    /// use eventplane::wire::Dialect;
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
    /// // A worker: its registrations are what a Dynamo 1.6 worker would write.
    /// let discovery = EtcdDiscovery::builder(["http://127.0.0.1:2379"])
    ///     .dialect(Dialect::Dynamo)
    ///     .records(DynamoRecords::new().endpoint("generate").worker(77, 0))
    ///     .connect()
    ///     .await?;
    /// # let _ = discovery;
    /// # Ok(()) }
    /// ```
    pub fn dialect(mut self, dialect: Dialect) -> Self {
        self.config.dialect = dialect;
        self
    }

    /// Dynamo's records: the endpoint registrations are written under (and watches
    /// narrowed to) and the worker they speak for. Default: every endpoint, no
    /// worker. Only with [`dialect(Dialect::Dynamo)`](Self::dialect); set with our
    /// dialect, [`validate`](Self::validate) refuses it (`records`).
    ///
    /// ```
    /// use eventplane::discovery::{DynamoRecords, EtcdDiscovery};
    /// let builder = EtcdDiscovery::builder(["http://127.0.0.1:2379"])
    ///     .records(DynamoRecords::new().endpoint("generate"));
    /// assert!(builder.validate().is_err()); // still our dialect
    /// ```
    pub fn records(mut self, records: DynamoRecords) -> Self {
        self.config.records = Some(records);
        self
    }

    /// Lease TTL: how long registrations outlive this process (or an outage). Default
    /// 10 s, renewed every TTL/3; 2 s ..= 1 h, whole seconds.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.config.lease_ttl = ttl;
        self
    }

    /// How long `connect` waits for etcd to answer its readiness check. Default 5 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.config.connect_timeout = timeout;
        self
    }

    /// Deadline of each request to etcd (a `register`, one page of a `list`, a watch's
    /// creation). Default 5 s.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.config.request_timeout = timeout;
        self
    }

    /// Events buffered per watch before its backlog collapses into a `Resync`. Default
    /// 1024 (about 200 bytes each, plus the instances a `Resync` carries).
    pub fn watch_buffer(mut self, events: usize) -> Self {
        self.config.watch_buffer = events;
        self
    }

    /// Keys read per page by `list` and a watch's (re)sync. Default 1000; a page too
    /// large for the client's 4 MiB message limit is retried smaller.
    pub fn page_size(mut self, keys: usize) -> Self {
        self.config.page_size = keys;
        self
    }

    /// Records larger than this are skipped as malformed. Default 64 KiB.
    pub fn max_value_bytes(mut self, bytes: usize) -> Self {
        self.config.max_value_bytes = bytes;
        self
    }

    /// Authenticates as `user` (etcd with auth enabled); the token is refreshed when it
    /// expires. Default: no authentication. (Plain `http://` endpoints: run etcd on a
    /// trusted network or behind a TLS tunnel.)
    pub fn credentials(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.config.credentials = Some((user.into(), config::Password(password.into())));
        self
    }

    /// Reconnect backoff of watches and the keep-alive (jittered, never below the
    /// minimum: [`Backoff`](crate::net::Backoff)). Default
    /// 250 ms → 5 s.
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.config.backoff_min = min;
        self.config.backoff_max = max;
        self
    }

    /// The first refused setting, if any, named as its setter; [`connect`](Self::connect)
    /// calls it first. Call it to tell a bad argument from an unreachable etcd
    /// without going to the network.
    ///
    /// ```
    /// use std::time::Duration;
    /// use eventplane::discovery::EtcdDiscovery;
    /// let builder = EtcdDiscovery::builder(["http://127.0.0.1:2379"]).lease_ttl(Duration::from_millis(2500));
    /// assert_eq!(builder.validate().unwrap_err().field(), "lease_ttl"); // whole seconds only
    /// ```
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        self.config.validate()
    }

    /// Validates the settings, checks that etcd answers (a status request, since the
    /// client itself connects lazily) and that our keys may be read (a one-key read
    /// under the prefix), grants the lease and starts its keep-alive.
    ///
    /// # Errors
    /// [`DiscoveryError::InvalidConfig`] for bad settings,
    /// [`DiscoveryError::Denied`] when etcd refuses the credentials (or, without
    /// credentials, requires them), [`DiscoveryError::Unavailable`] when etcd does
    /// not answer in time.
    pub async fn connect(self) -> Result<EtcdDiscovery, DiscoveryError> {
        EtcdDiscovery::start(self.config).await
    }
}
