//! `KubeDiscovery`: discovery on Kubernetes through Dynamo's `DynamoWorkerMetadata`
//! resources (feature `kube`).

mod builder;
mod capped;
mod config;
mod error;
mod follow;
mod ids;
mod join;
mod narrow;
mod resource;
mod shared;
mod writer;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tracing::{Instrument, info};

pub use builder::KubeDiscoveryBuilder;
pub use config::{KubeMode, PodIdentity};
pub use ids::kube_instance_id;
use shared::{Counters, Shared};
use writer::Writer;

use crate::BoxFuture;
use crate::config::ConfigError;
use crate::discovery::{
    ChannelId, Discovery, DiscoveryError, DiscoveryStats, DiscoveryStream, Instance, Query,
    Registration, RegistrationHandle, Transport, WorkerIdentity,
};
use crate::net::RateLimitedWarn;

/// Discovery on Kubernetes, wire-compatible with Dynamo 1.6.1 (feature `kube`).
///
/// Each worker pod server-side-applies one `DynamoWorkerMetadata` custom resource
/// (`nvidia.com/v1alpha1`, namespaced) whose `spec.data` holds Dynamo's four maps
/// (`endpoints`, `model_cards`, `event_channels`, `event_sources`); readers join those
/// resources with readiness, exactly as Dynamo's own router does:
///
/// - **Reading**: for each followed Kubernetes namespace, the resources and (pod
///   mode) the EndpointSlices labelled `nvidia.com/dynamo-discovery-enabled=true`, or
///   (container mode) the Pods so labelled, are listed in pages of 32 (one raw page
///   held at a time) and watched from the list's `resourceVersion` with bookmarks and
///   `timeoutSeconds=290`. A resource's publishers (its `event_channels` entries of
///   endpoint scope, each with the worker its `event_sources` entry names) are visible
///   only while readiness names the resource ready with the uid of the pod that owns it
///   (`ownerReferences`, kind `Pod`): an endpoint with `conditions.ready` and a
///   `targetRef` {name = the resource's name, uid}, or a ready container; two uids for
///   one name exclude it. A new pod incarnation never matches old metadata.
/// - **Records**: Dynamo's, as [`DynamoRecords`](crate::discovery::DynamoRecords)
///   describes, keyed by the etcd path without `v1/event_channels/`; the legacy
///   trailing `namespace`/`component` fields are accepted and written; a worker's
///   recovery endpoint ([`Instance::recovery`], registered with
///   [`register_instance`](Discovery::register_instance) beside a worker) travels in
///   its `EventSource` record as `metadata.eventplane_recovery` (Dynamo's router ignores
///   it; one that is not `tcp://host:port` is dropped with a warning); a `null` map is
///   empty (a real API server turns an emptied map into `null`); `endpoints` and
///   `model_cards` are not read. The incarnation of a publisher is its resource's
///   `resourceVersion` (an integer on every etcd-backed API server; a resource whose
///   version is not one is skipped as malformed).
/// - **Bounds** (all settable on the builder): 16,384 resources per namespace, 1,024
///   `event_channels` entries inspected and 256 publishers kept per resource, 65,536
///   publishers in all, keys ≤ 1 KiB, values ≤ 64 KiB as JSON, advertised endpoints ≤
///   1 KiB. A malformed entry or resource, or one over a bound, is skipped and counted
///   in [`DiscoveryStats::malformed`] (logged, rate-limited), never failing its page;
///   a resource over the total has its earlier advertisement withdrawn.
/// - **Fair caps**: a resource no pod owns can never join and costs nothing (neither
///   kept nor counted). A joined resource needing room (its namespace's resource cap,
///   or the publisher total) evicts resources that are not joined (owned by a pod that
///   is not ready with that uid), the one advertising the most publishers first,
///   counted; joined resources are never evicted. One not joined yet makes no room: it
///   is refused, counted, and remembered with its evicted peers (at most
///   `max_resources`), and when readiness names one of them ready everything is read
///   again, where it makes its room. A publisher id two joined resources advertise is shown
///   from the older (`creationTimestamp`, set by the server; then its name), the other
///   counted; when the older goes, the next shows it. A `ResourceQuota` on
///   `count/dynamoworkermetadatas.nvidia.com` per namespace bounds what a tenant can
///   create at all. Readiness is bounded too, per namespace: `max_resources`
///   readiness objects, and as many ready entries in all and one object's more (past
///   it, entries naming no resource held are dropped first, counted).
/// - **Read narrowly**: only a resource's name, version, owner references and the two
///   maps are read; every other field (`model_cards`, `endpoints`, `managedFields`…)
///   is skipped by serde_json's skipping reader, whatever its depth or size, and the
///   entries past a bound are skipped while reading, never held. A list page is split
///   into items before any is parsed (one that does not parse is one malformed
///   resource; more items than asked for fail the page); a page is at most
///   `max_page_bytes` (64 MiB) and a watch event at most 4 MiB, read before they are
///   parsed (a longer page is asked for again with half as many resources, down to
///   one; a longer event reads everything afresh). A watch event whose object does
///   not parse withdraws that resource (counted); one without a name or version reads
///   everything afresh. This process's own applies read only the version of the
///   resource the server answers with.
/// - **The watch contract** holds: `watch` returns once every watch is open; a watch
///   the server ends is opened again from the last version seen (bookmarks keep it
///   fresh); one silent past its timeout + 10 s is opened again; a version gone (410)
///   reads everything afresh and ends in one `Resync`
///   ([`DiscoveryStats::reconnects`]); a continue token gone part-way through a list
///   (410) starts the read again, with no `Resync` of its own. A watch opened again
///   or a read afresh that the server refuses is retried with backoff, and waits at
///   least the `Retry-After` (at most 30 s) of a 429 or 5xx that names one. A read
///   (`list`, the first view of `watch`) refused with a `Retry-After` is asked again
///   after it, three attempts in all; any other refusal is the caller's error.
/// - **Writing** needs a [`PodIdentity`]: `register` server-side-applies this
///   process's resource (field manager `dynamo-worker`, `force`, owner reference to the
///   pod — `controller: true` in pod mode, `false` in container mode — all four maps),
///   re-applying the whole resource on each change under one lock and rolling the
///   change back locally if the apply fails. Dropping a `register` future part-way is
///   safe (rolled back, re-applied in the background); a dropped guard is removed in the
///   background; [`close`](Self::close) applies every map empty (Dynamo's shutdown; the
///   resource stays, and goes with its pod). In container mode a stale resource of the
///   same name is deleted first. [`Registration::detach`] leaves the record in place
///   until the pod goes, as a crash would.
///
/// The client is inferred as kube-rs does (`KUBECONFIG` or `~/.kube/config`, then the
/// in-cluster service account), or given with [`KubeDiscoveryBuilder::client`]. It
/// needs `get`/`list`/`watch` on `dynamoworkermetadatas` and `endpointslices` (or
/// `pods`), and `patch` (plus `delete` in container mode) on its own resource to
/// register.
///
/// ```no_run
/// use eventplane::discovery::{ChannelId, Discovery, DynamoRecords, KubeDiscovery, PodIdentity, Query, Transport};
/// # #[tokio::main]
/// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
/// let discovery = KubeDiscovery::builder()
///     .records(DynamoRecords::new().endpoint("generate").worker(77, 0))
///     .pod(PodIdentity::from_env()?)
///     .connect()
///     .await?;
/// let id = ChannelId::new("dynamo", "backend", "kv-events", 0x1e39a6adfd5f2a)?;
/// let registration = discovery.register(id, Transport::zmq("tcp://10.0.0.5:41234")).await?;
/// let seen = discovery.list(Query::new("dynamo")).await?; // once the pod is ready
/// # drop(seen);
/// registration.unregister().await?;
/// discovery.close().await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct KubeDiscovery {
    handle: Arc<Handle>,
}

struct Handle {
    shared: Arc<Shared>,
    writer: Option<Arc<Writer>>,
    /// The running watch task its watches share.
    hub: follow::Hub,
}

impl Drop for Handle {
    fn drop(&mut self) {
        if let Some(w) = &self.writer {
            w.shutdown.cancel();
        }
    }
}

impl fmt::Debug for KubeDiscovery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeDiscovery")
            .field("namespaces", &self.handle.shared.namespaces)
            .field("mode", &self.handle.shared.mode)
            .field("resource", &self.handle.writer.as_ref().map(|w| w.name()))
            .finish_non_exhaustive()
    }
}

impl KubeDiscovery {
    /// A builder with every default (see [`KubeDiscoveryBuilder`]).
    pub fn builder() -> KubeDiscoveryBuilder {
        KubeDiscoveryBuilder::default()
    }

    async fn start(config: config::KubeConfig) -> Result<KubeDiscovery, DiscoveryError> {
        config.validate().map_err(DiscoveryError::InvalidConfig)?;
        let client = match &config.client {
            Some(c) => c.clone(),
            None => kube::Client::try_default().await.map_err(|e| {
                DiscoveryError::InvalidConfig(ConfigError::Invalid {
                    field: "client",
                    reason: format!(
                        "no Kubernetes client configuration (kubeconfig or in-cluster): {e}"
                    ),
                })
            })?,
        };
        let namespaces = if !config.namespaces.is_empty() {
            config.namespaces.clone()
        } else if let Some(pod) = &config.pod {
            vec![pod.namespace.clone()]
        } else {
            vec![client.default_namespace().to_owned()]
        };
        let mode = config.mode();
        let pod = config.pod.clone();
        let shared = Arc::new(Shared {
            client,
            config,
            namespaces,
            mode,
            counters: Counters::default(),
            warn: RateLimitedWarn::default(),
        });
        let writer = match pod {
            Some(pod) => {
                let writer = Arc::new(Writer::new(Arc::clone(&shared), &pod));
                if pod.container.is_some() {
                    writer.delete_stale().await?;
                }
                let span = tracing::debug_span!("kube_registrations", resource = %writer.name());
                tokio::spawn(Arc::clone(&writer).run().instrument(span));
                Some(writer)
            }
            None => None,
        };
        info!(namespaces = ?shared.namespaces, ?mode, "following DynamoWorkerMetadata resources");
        Ok(KubeDiscovery {
            handle: Arc::new(Handle {
                shared,
                writer,
                hub: follow::Hub::default(),
            }),
        })
    }

    /// The Dynamo instance id of this process's resource ([`kube_instance_id`] of its
    /// name), `None` without a pod identity: what a Dynamo worker on Kubernetes uses
    /// as its worker id.
    ///
    /// ```no_run
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
    /// use eventplane::discovery::{KubeDiscovery, PodIdentity};
    /// let discovery = KubeDiscovery::builder().pod(PodIdentity::from_env()?).connect().await?;
    /// println!("worker id {:?}", discovery.instance_id());
    /// # Ok(()) }
    /// ```
    pub fn instance_id(&self) -> Option<u64> {
        self.handle
            .writer
            .as_ref()
            .map(|w| kube_instance_id(w.name()))
    }

    /// The followed Kubernetes namespaces.
    pub fn namespaces(&self) -> &[String] {
        &self.handle.shared.namespaces
    }

    /// Applies this process's resource with every map empty (Dynamo's shutdown; the
    /// resource is not deleted) and stops maintaining registrations. Best effort: a
    /// failure is logged.
    ///
    /// ```no_run
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
    /// use eventplane::discovery::{KubeDiscovery, PodIdentity};
    /// let discovery = KubeDiscovery::builder().pod(PodIdentity::from_env()?).connect().await?;
    /// discovery.close().await;
    /// # Ok(()) }
    /// ```
    pub async fn close(&self) {
        if let Some(w) = &self.handle.writer {
            w.close().await;
        }
    }
}

impl Discovery for KubeDiscovery {
    fn register_with(
        &self,
        id: ChannelId,
        transport: Transport,
        worker: Option<WorkerIdentity>,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        let mut instance = Instance::new(id, transport, 0);
        instance.worker = worker;
        self.register_instance(instance)
    }

    /// Registers `instance`; its recovery endpoint goes into its `EventSource` record
    /// (`metadata.eventplane_recovery`), written only when the registration names a
    /// worker (with `instance.worker` or `DynamoRecords::worker`).
    fn register_instance(
        &self,
        instance: Instance,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        let (id, transport, worker, recovery) = instance.into_registered();
        Box::pin(async move {
            let Some(writer) = &self.handle.writer else {
                return Err(DiscoveryError::InvalidConfig(ConfigError::Invalid {
                    field: "pod",
                    reason:
                        "registering on Kubernetes needs a pod identity (KubeDiscoveryBuilder::pod)"
                            .to_owned(),
                }));
            };
            let (instance, serial) = writer
                .register(id.clone(), transport, worker, recovery)
                .await?;
            Ok(Registration::new(
                instance,
                Box::new(KubeRegistration {
                    handle: Arc::clone(&self.handle),
                    id,
                    serial,
                }),
            ))
        })
    }

    fn list(&self, query: Query) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>> {
        Box::pin(async move {
            let (join, _) = self.handle.shared.read_all().await?;
            Ok(Shared::matching(&join, &query))
        })
    }

    fn watch(
        &self,
        query: Query,
        cancel: tokio_util::sync::CancellationToken,
    ) -> BoxFuture<'_, Result<DiscoveryStream, DiscoveryError>> {
        Box::pin(async move {
            follow::start(
                Arc::clone(&self.handle.shared),
                &self.handle.hub,
                query,
                cancel,
            )
            .await
        })
    }

    fn stats(&self) -> DiscoveryStats {
        let c = &self.handle.shared.counters;
        let mut stats = DiscoveryStats {
            registrations: c.registrations.load(Ordering::Relaxed),
            malformed: c.malformed.load(Ordering::Relaxed),
            reconnects: c.reconnects.load(Ordering::Relaxed),
            ..DiscoveryStats::default()
        };
        c.watch.fill(&mut stats);
        stats
    }
}

/// The guard behind a Kubernetes [`Registration`].
struct KubeRegistration {
    handle: Arc<Handle>,
    id: ChannelId,
    serial: u64,
}

impl fmt::Debug for KubeRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeRegistration")
            .field("id", &self.id)
            .field("serial", &self.serial)
            .finish()
    }
}

impl RegistrationHandle for KubeRegistration {
    fn unregister(self: Box<Self>) -> BoxFuture<'static, Result<(), DiscoveryError>> {
        Box::pin(async move {
            match &self.handle.writer {
                Some(w) => w.unregister(&self.id, self.serial).await,
                None => Ok(()),
            }
        })
    }

    fn release(self: Box<Self>) {
        if let Some(w) = &self.handle.writer {
            w.release(self.id.clone(), self.serial);
        }
    }

    fn detach(self: Box<Self>) {
        // The record stays until the pod goes (its readiness ends), as after a crash.
    }
}
