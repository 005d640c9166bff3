//! A discovery backend named by configuration, and the one function that builds it.

use std::sync::Arc;

use super::{Discovery, DiscoveryError, Instance, MemoryDiscovery, Query, StaticDiscovery};
use crate::BoxFuture;
use crate::config::ConfigError;
use crate::discovery::WorkerIdentity;
use crate::wire::Dialect;

/// Which discovery backend a process uses, as its flags or configuration file name it,
/// built by [`connect`](Self::connect): the one place eventplane's services and
/// examples turn configuration into a [`Discovery`], and one yours can use too.
///
/// Every value is plain (strings, numbers, [`Dialect`]), so the same code compiles
/// whatever features are on; a backend this build lacks (`etcd`, `kube`) is refused by
/// `connect` with [`DiscoveryError::InvalidConfig`] naming the feature, and so is a
/// setting that does not apply to the backend chosen (the table), rather than
/// ignored.
///
/// | backend | settings that apply |
/// |---|---|
/// | [`memory`](Self::memory), [`fixed`](Self::fixed) | none |
/// | [`etcd`](Self::etcd) | [`dialect`](Self::dialect); in [`Dialect::Dynamo`], [`dynamo_endpoint`](Self::dynamo_endpoint) and [`worker`](Self::worker) |
/// | [`kube`](Self::kube) | Dynamo's records always: [`dynamo_endpoint`](Self::dynamo_endpoint), [`worker`](Self::worker); [`kube_namespaces`](Self::kube_namespaces), [`kube_containers`](Self::kube_containers), [`kube_pod_from_env`](Self::kube_pod_from_env) |
///
/// ```
/// use eventplane::discovery::{Backend, ChannelId, Instance, Query, Transport};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
/// let id = ChannelId::new("prod", "worker", "kv-events", 1)?;
/// let fixed = vec![Instance::new(id, Transport::zmq("tcp://10.0.0.5:5557"), 1)];
/// // Checked by one `list` before `connect` returns.
/// let connected = Backend::fixed(fixed).check(Query::new("prod")).connect().await?;
/// assert_eq!(connected.discovery().list(Query::new("prod")).await?.len(), 1);
/// connected.close().await;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct Backend {
    kind: Kind,
    /// `None` until [`dialect`](Self::dialect) is called.
    dialect: Option<Dialect>,
    dynamo_endpoint: Option<String>,
    worker: Option<WorkerIdentity>,
    kube_namespaces: Vec<String>,
    kube_containers: bool,
    kube_pod_from_env: bool,
    check: Option<Query>,
}

#[derive(Debug, Clone)]
enum Kind {
    Memory,
    Fixed(Vec<Instance>),
    Etcd(#[cfg_attr(not(feature = "etcd"), allow(dead_code))] Vec<String>),
    Kube,
}

/// Closes a backend that holds something remote (etcd's lease).
type Closer = Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>;

/// A connected backend ([`Backend::connect`]): the [`Discovery`] to share, and
/// [`close`](Self::close) to call at exit so registrations go at once (etcd revokes
/// its lease) instead of when they expire.
pub struct Connected {
    discovery: Arc<dyn Discovery>,
    closer: Option<Closer>,
}

impl std::fmt::Debug for Connected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connected")
            .field("discovery", &self.discovery)
            .finish_non_exhaustive()
    }
}

impl Connected {
    /// A backend holding registrations remotely, withdrawn by `close` at exit.
    #[cfg(any(feature = "etcd", feature = "kube"))]
    fn remote<D>(discovery: D, close: fn(D) -> BoxFuture<'static, ()>) -> Connected
    where
        D: Discovery + Clone + 'static,
    {
        let closing = discovery.clone();
        Connected {
            discovery: Arc::new(discovery),
            closer: Some(Box::new(move || close(closing))),
        }
    }

    /// The backend, to hand to publishers and subscribers.
    pub fn discovery(&self) -> &Arc<dyn Discovery> {
        &self.discovery
    }

    /// Withdraws this process's registrations now (etcd: revokes the lease, so every
    /// registration goes at once; Kubernetes: applies its resource empty, as Dynamo
    /// does at shutdown). Nothing to do for the in-process backends.
    pub async fn close(self) {
        if let Some(close) = self.closer {
            close().await;
        }
    }
}

impl Backend {
    fn of(kind: Kind) -> Backend {
        Backend {
            kind,
            dialect: None,
            dynamo_endpoint: None,
            worker: None,
            kube_namespaces: Vec::new(),
            kube_containers: false,
            kube_pod_from_env: false,
            check: None,
        }
    }

    /// An in-process [`MemoryDiscovery`] with its defaults.
    pub fn memory() -> Backend {
        Backend::of(Kind::Memory)
    }

    /// A fixed set of publishers ([`StaticDiscovery`]); nothing registers.
    pub fn fixed(instances: Vec<Instance>) -> Backend {
        Backend::of(Kind::Fixed(instances))
    }

    /// etcd at `endpoints` (feature `etcd`), with [`EtcdDiscovery`]'s defaults
    /// otherwise.
    ///
    /// [`EtcdDiscovery`]: crate::discovery::EtcdDiscovery
    pub fn etcd<I, S>(endpoints: I) -> Backend
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Backend::of(Kind::Etcd(endpoints.into_iter().map(Into::into).collect()))
    }

    /// The Kubernetes API server of the cluster this process runs in (feature
    /// `kube`), holding Dynamo's records.
    pub fn kube() -> Backend {
        Backend::of(Kind::Kube)
    }

    /// Whose records etcd holds: ours (the default) or Dynamo's. Kubernetes holds
    /// Dynamo's only (`Dialect::EventPlane` is refused there).
    pub fn dialect(mut self, dialect: Dialect) -> Self {
        self.dialect = Some(dialect);
        self
    }

    /// The Dynamo endpoint (e.g. `generate`) registrations are written under and
    /// watches narrowed to, in Dynamo's records. Default: none (every endpoint is
    /// followed; registering is refused).
    pub fn dynamo_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.dynamo_endpoint = Some(endpoint.into());
        self
    }

    /// The worker this process's registrations speak for, in Dynamo's records (ours
    /// carry it per registration). Default: none.
    pub fn worker(mut self, worker: WorkerIdentity) -> Self {
        self.worker = Some(worker);
        self
    }

    /// Kubernetes namespaces to follow. Default (empty): the process's own.
    pub fn kube_namespaces(mut self, namespaces: Vec<String>) -> Self {
        self.kube_namespaces = namespaces;
        self
    }

    /// One Kubernetes resource per container (`KubeMode::Container`) rather than per
    /// pod. Default `false`.
    pub fn kube_containers(mut self, containers: bool) -> Self {
        self.kube_containers = containers;
        self
    }

    /// Registers on Kubernetes as the pod the downward API names in the environment
    /// (`PodIdentity::from_env`). Default `false`: follow only.
    pub fn kube_pod_from_env(mut self, register: bool) -> Self {
        self.kube_pod_from_env = register;
        self
    }

    /// After connecting, lists `query` once, so that a backend that cannot be reached
    /// or read fails `connect` rather than the first watch. Default: no check (etcd
    /// checks its endpoints when connecting anyway).
    pub fn check(mut self, query: Query) -> Self {
        self.check = Some(query);
        self
    }

    /// The backend, built and connected. Settings a backend refuses, and a backend
    /// this build lacks, are [`DiscoveryError::InvalidConfig`]; the rest is what the
    /// backend's own `connect` (or the [`check`](Self::check)) returned.
    pub async fn connect(self) -> Result<Connected, DiscoveryError> {
        self.refuse_what_does_not_apply()?;
        let check = self.check.clone();
        let connected = match self.kind {
            Kind::Memory => Connected {
                discovery: Arc::new(MemoryDiscovery::new()),
                closer: None,
            },
            Kind::Fixed(ref instances) => Connected {
                discovery: Arc::new(StaticDiscovery::new(instances.clone())),
                closer: None,
            },
            Kind::Etcd(_) => self.connect_etcd().await?,
            Kind::Kube => self.connect_kube().await?,
        };
        if let Some(query) = check {
            if let Err(e) = connected.discovery.list(query).await {
                connected.close().await;
                return Err(e);
            }
        }
        Ok(connected)
    }

    /// The first setting the chosen backend would not use, refused by name.
    fn refuse_what_does_not_apply(&self) -> Result<(), DiscoveryError> {
        let dynamo = self.dynamo_endpoint.is_some() || self.worker.is_some();
        let kube =
            !self.kube_namespaces.is_empty() || self.kube_containers || self.kube_pod_from_env;
        let (setting, reason) = match &self.kind {
            Kind::Memory | Kind::Fixed(_) if self.dialect.is_some() || dynamo || kube => (
                "backend",
                "the in-process backends take no dialect, Dynamo or Kubernetes setting",
            ),
            Kind::Etcd(_) if kube => ("kube_*", "Kubernetes settings on etcd"),
            Kind::Etcd(_) if dynamo && self.dialect != Some(Dialect::Dynamo) => (
                "dynamo_endpoint / worker",
                "Dynamo's records' settings need dialect(Dialect::Dynamo) on etcd",
            ),
            Kind::Kube if self.dialect == Some(Dialect::EventPlane) => {
                ("dialect", "Kubernetes holds Dynamo's records only")
            }
            _ => return Ok(()),
        };
        Err(DiscoveryError::InvalidConfig(ConfigError::Invalid {
            field: setting,
            reason: reason.to_owned(),
        }))
    }

    #[cfg(any(feature = "etcd", feature = "kube"))]
    fn records(&self) -> super::DynamoRecords {
        let mut records = super::DynamoRecords::new();
        if let Some(endpoint) = &self.dynamo_endpoint {
            records = records.endpoint(endpoint.clone());
        }
        if let Some(w) = self.worker {
            records = records.worker(w.worker_id, w.dp_rank);
        }
        records
    }

    #[cfg(feature = "etcd")]
    async fn connect_etcd(self) -> Result<Connected, DiscoveryError> {
        let Kind::Etcd(endpoints) = &self.kind else {
            unreachable!("connect_etcd is only called for Kind::Etcd")
        };
        let dialect = self.dialect.unwrap_or_default();
        let mut builder = super::EtcdDiscovery::builder(endpoints).dialect(dialect);
        if dialect == Dialect::Dynamo {
            builder = builder.records(self.records());
        }
        let discovery = builder.connect().await?;
        Ok(Connected::remote(discovery, |d| {
            Box::pin(async move { d.close().await })
        }))
    }

    #[cfg(not(feature = "etcd"))]
    async fn connect_etcd(self) -> Result<Connected, DiscoveryError> {
        Err(not_built("etcd"))
    }

    #[cfg(feature = "kube")]
    async fn connect_kube(self) -> Result<Connected, DiscoveryError> {
        let mut builder = super::KubeDiscovery::builder().records(self.records());
        if !self.kube_namespaces.is_empty() {
            builder = builder.namespaces(self.kube_namespaces.clone());
        }
        if self.kube_containers {
            builder = builder.mode(super::KubeMode::Container);
        }
        if self.kube_pod_from_env {
            builder = builder.pod(super::PodIdentity::from_env()?);
        }
        let discovery = builder.connect().await?;
        Ok(Connected::remote(discovery, |d| {
            Box::pin(async move { d.close().await })
        }))
    }

    #[cfg(not(feature = "kube"))]
    async fn connect_kube(self) -> Result<Connected, DiscoveryError> {
        Err(not_built("kube"))
    }
}

/// A backend this build was compiled without.
#[cfg(not(all(feature = "etcd", feature = "kube")))]
fn not_built(feature: &'static str) -> DiscoveryError {
    DiscoveryError::InvalidConfig(ConfigError::Invalid {
        field: feature,
        reason: format!(
            "this build has no {feature} support: build eventplane with feature `{feature}` \
             (eventplane-services and the examples: --features {feature})"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::{ChannelId, Transport};

    #[tokio::test]
    async fn the_in_process_backends_connect_and_a_check_lists() {
        let id = ChannelId::new("ns", "c", "t", 1).unwrap();
        let one = Instance::new(id, Transport::zmq("tcp://10.0.0.5:5557"), 1);
        let fixed = Backend::fixed(vec![one.clone()])
            .check(Query::new("ns"))
            .connect()
            .await
            .unwrap();
        assert_eq!(
            fixed.discovery().list(Query::new("ns")).await.unwrap(),
            vec![one]
        );
        fixed.close().await;
        let memory = Backend::memory().connect().await.unwrap();
        assert!(
            memory
                .discovery()
                .list(Query::new("ns"))
                .await
                .unwrap()
                .is_empty()
        );
    }

    #[tokio::test]
    async fn a_setting_the_backend_would_not_use_is_refused_by_name() {
        let refused = |b: Backend| async move {
            match b.connect().await {
                Err(DiscoveryError::InvalidConfig(ConfigError::Invalid { field, .. })) => field,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(
            refused(Backend::memory().kube_containers(true)).await,
            "backend"
        );
        assert_eq!(
            refused(Backend::etcd(["http://127.0.0.1:1"]).dynamo_endpoint("generate")).await,
            "dynamo_endpoint / worker"
        );
        assert_eq!(
            refused(Backend::etcd(["http://127.0.0.1:1"]).kube_namespaces(vec!["a".into()])).await,
            "kube_*"
        );
        assert_eq!(
            refused(Backend::kube().dialect(Dialect::EventPlane)).await,
            "dialect"
        );
    }

    #[cfg(not(feature = "etcd"))]
    #[tokio::test]
    async fn a_backend_this_build_lacks_is_a_config_error_naming_its_feature() {
        let err = Backend::etcd(["http://127.0.0.1:2379"])
            .connect()
            .await
            .unwrap_err();
        assert!(
            matches!(&err, DiscoveryError::InvalidConfig(c) if c.to_string().contains("feature `etcd`")),
            "{err}"
        );
    }
}
