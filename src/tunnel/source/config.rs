//! A [`Source`](crate::tunnel::Source)'s configuration: where it dials, with what
//! credential, and its bounds.

use std::sync::Arc;
use std::time::Duration;

use crate::tunnel::config::{Deadlines, check_client};
use crate::tunnel::error::TunnelError;
use crate::tunnel::io::Secret;

/// Most publishers one [`Source`](crate::tunnel::Source) announces by default.
pub(crate) const MAX_SOURCE_PUBLISHERS: usize = 1024;

/// How a [`Source`](crate::tunnel::Source) reaches its bus, and its bounds.
///
/// ```no_run
/// use eventplane::tunnel::{Secret, SourceConfig, client_tls};
/// # fn run() -> Result<(), eventplane::tunnel::TunnelError> {
/// let config = SourceConfig::new(
///     "https://router.example:8443",
///     "gpu-box-1",
///     vec!["prod".into()],
///     Secret::from_file("source.token")?,
///     client_tls("bus-ca.pem")?,
/// );
/// config.validate()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct SourceConfig {
    pub(crate) bus_url: String,
    pub(crate) client_id: String,
    pub(crate) namespaces: Vec<String>,
    pub(crate) token: Secret,
    pub(crate) tls: Arc<rustls::ClientConfig>,
    pub(crate) deadlines: Deadlines,
    pub(crate) drain_deadline: Duration,
    pub(crate) reconnect_min: Duration,
    pub(crate) reconnect_max: Duration,
    pub(crate) max_publishers: usize,
}

/// Settings: each setter documents its default.
impl SourceConfig {
    /// The bus, `https://host:port`. Required: `new` sets it; this replaces it.
    #[must_use]
    pub fn bus_url(mut self, bus_url: impl Into<String>) -> Self {
        self.bus_url = bus_url.into();
        self
    }

    /// Its client id (its credential must be bound to it, with the `source` role). Required: `new` sets it; this replaces it.
    #[must_use]
    pub fn client_id(mut self, client_id: impl Into<String>) -> Self {
        self.client_id = client_id.into();
        self
    }

    /// The namespaces it announces in (each publisher's must be one of them). Required: `new` sets it; this replaces it.
    #[must_use]
    pub fn namespaces(mut self, namespaces: Vec<String>) -> Self {
        self.namespaces = namespaces;
        self
    }

    /// Its bearer credential. Required: `new` sets it; this replaces it.
    #[must_use]
    pub fn token(mut self, token: Secret) -> Self {
        self.token = token;
        self
    }

    /// The CA its bus certificate must chain to. Required: `new` sets it; this replaces it.
    #[must_use]
    pub fn tls(mut self, tls: Arc<rustls::ClientConfig>) -> Self {
        self.tls = tls;
        self
    }

    /// Deadlines of the bus connection and of each data stream's stages. Default
    /// [`Deadlines::default`] (each stated on its setter).
    #[must_use]
    pub fn deadlines(mut self, deadlines: Deadlines) -> Self {
        self.deadlines = deadlines;
        self
    }

    /// The shortest reconnect delay after a failed session (default 1 s): the backoff
    /// doubles, jittered, up to [`reconnect_max`](Self::reconnect_max), and starts
    /// over once a session held for 10 s.
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

    /// Most publishers it announces at once (default 1,024, at
    /// most 2,112: what its hello and a burst of `announce` frames carry; the welcome's
    /// [`Limits::max_sources`](crate::tunnel::Limits), set by the bus's `EventBusConfig::limits`,
    /// may be lower). Its `announce` frames are paced as the router counts them
    /// (32 at once, then 4 a second): changes wait and merge.
    #[must_use]
    pub fn max_publishers(mut self, max_publishers: usize) -> Self {
        self.max_publishers = max_publishers;
        self
    }
}

impl std::fmt::Debug for SourceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceConfig")
            .field("bus_url", &self.bus_url)
            .field("client_id", &self.client_id)
            .field("namespaces", &self.namespaces)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

impl SourceConfig {
    /// A source `client_id` announcing in `namespaces` on the bus at `bus_url`, with
    /// the defaults above.
    pub fn new(
        bus_url: impl Into<String>,
        client_id: impl Into<String>,
        namespaces: Vec<String>,
        token: Secret,
        tls: Arc<rustls::ClientConfig>,
    ) -> SourceConfig {
        SourceConfig {
            bus_url: bus_url.into(),
            client_id: client_id.into(),
            namespaces,
            token,
            tls,
            deadlines: Deadlines::default(),
            drain_deadline: Duration::from_secs(5),
            reconnect_min: Duration::from_secs(1),
            reconnect_max: Duration::from_secs(60),
            max_publishers: MAX_SOURCE_PUBLISHERS,
        }
    }

    /// How long open streams may run once the source drains (default 5 s).
    #[must_use]
    pub fn drain_deadline(mut self, deadline: Duration) -> SourceConfig {
        self.drain_deadline = deadline;
        self
    }

    /// The first refused setting, if any.
    pub fn validate(&self) -> Result<(), TunnelError> {
        let refuse =
            |field: &'static str, reason: String| Err(TunnelError::Config { field, reason });
        // The hello carries up to 64 announcements beside the names: with the longest
        // announcements there are, it must still fit one frame.
        let longest = "n".repeat(crate::tunnel::MAX_SOURCE_NAME_LEN);
        let widest = crate::tunnel::AnnouncedSource {
            publisher_id: u64::MAX,
            namespace: longest.clone(),
            component: longest.clone(),
            topic: longest,
            worker: Some(crate::discovery::WorkerIdentity::new(u64::MAX, u32::MAX)),
            dialect: crate::wire::Dialect::EventPlane,
            recovery: true,
        };
        check_client(
            &self.bus_url,
            &self.client_id,
            &self.namespaces,
            &vec![widest; crate::tunnel::MAX_ANNOUNCE],
        )?;
        self.deadlines.validate()?;
        if self.drain_deadline > Duration::from_secs(3600) {
            return refuse("drain_deadline", "is over an hour".into());
        }
        // The hello's and a burst of frames' worth (`ANNOUNCE_BURST`): more could not
        // be announced at connect without passing the router's announce rate.
        let most = crate::tunnel::MAX_ANNOUNCE * (crate::tunnel::ANNOUNCE_BURST as usize + 1);
        if self.max_publishers == 0 || self.max_publishers > most {
            return refuse("max_publishers", format!("is not within 1..={most}"));
        }
        if self.reconnect_min.is_zero() || self.reconnect_max < self.reconnect_min {
            return refuse(
                "reconnect_min",
                "must be non-zero and at most reconnect_max".into(),
            );
        }
        Ok(())
    }
}
