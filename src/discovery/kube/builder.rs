//! The builder of `KubeDiscovery`.

use std::time::Duration;

use super::KubeDiscovery;
use super::config::{KubeConfig, KubeMode, Limits, PodIdentity};
use crate::discovery::DiscoveryError;
use crate::discovery::records::DynamoRecords;

/// Builds a [`KubeDiscovery`]; every bound is documented with
/// its default.
///
/// ```no_run
/// use std::time::Duration;
/// use eventplane::discovery::{DynamoRecords, KubeDiscovery, PodIdentity};
/// # #[tokio::main]
/// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
/// let discovery = KubeDiscovery::builder()
///     .namespaces(["dynamo"])
///     .records(DynamoRecords::new().endpoint("generate").worker(77, 0))
///     .pod(PodIdentity::from_env()?)
///     .watch_timeout(Duration::from_secs(290))
///     .connect()
///     .await?;
/// # drop(discovery); Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct KubeDiscoveryBuilder {
    pub(crate) config: KubeConfig,
}

impl Default for KubeDiscoveryBuilder {
    fn default() -> Self {
        KubeDiscoveryBuilder {
            config: KubeConfig {
                client: None,
                namespaces: Vec::new(),
                mode: None,
                records: DynamoRecords::new(),
                pod: None,
                limits: Limits::default(),
                page_size: 32,
                request_timeout: Duration::from_secs(10),
                watch_open_timeout: Duration::from_secs(30),
                watch_timeout: Duration::from_secs(290),
                watch_buffer: 1024,
                backoff_min: Duration::from_millis(250),
                backoff_max: Duration::from_secs(5),
            },
        }
    }
}

macro_rules! setter {
    ($(#[$doc:meta])* $name:ident: $ty:ty => $($path:ident).+) => {
        $(#[$doc])*
        pub fn $name(mut self, value: $ty) -> Self {
            self.config.$($path).+ = value;
            self
        }
    };
}

impl KubeDiscoveryBuilder {
    /// Uses `client` instead of inferring one (kubeconfig, then the in-cluster
    /// service account, as `kube::Client::try_default` does).
    pub fn client(mut self, client: kube::Client) -> Self {
        self.config.client = Some(client);
        self
    }

    /// The Kubernetes namespaces to follow (default: the pod's namespace when
    /// registering for a pod, else the client's default namespace).
    pub fn namespaces<S: Into<String>>(mut self, namespaces: impl IntoIterator<Item = S>) -> Self {
        self.config.namespaces = namespaces.into_iter().map(Into::into).collect();
        self
    }

    /// Where readiness comes from (default: the pod identity's mode, else
    /// [`KubeMode::Pod`]).
    pub fn mode(mut self, mode: KubeMode) -> Self {
        self.config.mode = Some(mode);
        self
    }

    setter!(
        /// Which Dynamo endpoint to follow and register under, and the worker a
        /// registration publishes for (default: every endpoint, no worker; a
        /// registration's own [`WorkerIdentity`](crate::discovery::WorkerIdentity)
        /// takes precedence).
        records: DynamoRecords => records
    );

    /// The pod this process registers for (needed to register; see
    /// [`PodIdentity::from_env`]).
    pub fn pod(mut self, pod: PodIdentity) -> Self {
        self.config.pod = Some(pod);
        self
    }

    setter!(
        /// Resources read per list request (default 32): one raw page is held at a
        /// time. 1..=500.
        page_size: u32 => page_size
    );
    setter!(
        /// Resources kept per Kubernetes namespace (default 16,384); more are skipped
        /// and counted.
        max_resources: usize => limits.max_resources
    );
    setter!(
        /// `event_channels` entries inspected per resource (default 1,024), and
        /// readiness entries per EndpointSlice or Pod.
        max_channel_entries: usize => limits.max_channel_entries
    );
    setter!(
        /// Publishers kept per resource (default 256).
        max_publishers_per_resource: usize => limits.max_publishers_per_resource
    );
    setter!(
        /// Publishers kept in all (default 65,536): a resource that would exceed it has
        /// its advertisement withdrawn.
        max_publisher_refs: usize => limits.max_publisher_refs
    );
    setter!(
        /// Longest map key (default 1 KiB).
        max_key_bytes: usize => limits.max_key_bytes
    );
    setter!(
        /// Largest map value, as JSON (default 64 KiB).
        max_value_bytes: usize => limits.max_value_bytes
    );
    setter!(
        /// Most bytes of one list page, read before it is parsed (default 64 MiB: 32
        /// resources of etcd's largest, 1.5 MiB, with room). A page over it is asked
        /// for again with half as many resources, down to one.
        max_page_bytes: usize => limits.max_page_bytes
    );
    setter!(
        /// Deadline of each list page and each apply or delete (default 10 s).
        request_timeout: Duration => request_timeout
    );
    setter!(
        /// Deadline for opening a watch, up to its response head (default 30 s).
        watch_open_timeout: Duration => watch_open_timeout
    );
    setter!(
        /// The watch's `timeoutSeconds` (default 290 s, Dynamo's): the server ends it
        /// then and it is opened again from the last version seen. A watch silent for
        /// this long plus a slack (10 s, or the timeout itself when shorter; no event,
        /// no bookmark) is taken as stalled and opened again. Whole seconds, at least 1.
        watch_timeout: Duration => watch_timeout
    );
    setter!(
        /// Events each watch buffers for a slow consumer before collapsing them into
        /// one `Resync` (default 1024).
        watch_buffer: usize => watch_buffer
    );

    /// The backoff between attempts to re-establish a watch (default 250 ms → 5 s,
    /// jittered).
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.config.backoff_min = min;
        self.config.backoff_max = max;
        self
    }

    /// Validates the settings, builds the client and, in container mode with a pod,
    /// deletes a stale resource left by an earlier incarnation (as Dynamo does).
    ///
    /// # Errors
    /// [`DiscoveryError::InvalidConfig`] for a value out of range or no client
    /// configuration; [`DiscoveryError::Unavailable`] when the API server cannot be
    /// reached for that delete.
    pub async fn connect(self) -> Result<super::KubeDiscovery, DiscoveryError> {
        KubeDiscovery::start(self.config).await
    }
}
