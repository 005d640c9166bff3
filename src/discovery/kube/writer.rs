//! Registering on Kubernetes: this process's one `DynamoWorkerMetadata` resource,
//! server-side-applied whole (field manager `dynamo-worker`, forced) on every change
//! under one lock, as Dynamo does. A change whose apply fails is rolled back locally;
//! a `register` dropped part-way is rolled back too and the resource re-applied in
//! the background; dropped guards are removed in the background.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::config::PodIdentity;
use super::error::{has_status, within};
use super::narrow;
use super::resource::{ApplyBody, FIELD_MANAGER, PodRef, Written};
use super::shared::Shared;
use crate::config::ConfigError;
use crate::discovery::records::DynamoRecords;
use crate::discovery::{ChannelId, DiscoveryError, Instance, Transport, WorkerIdentity};
use crate::net::random_unit;

/// This process's resource and what it advertises.
pub(crate) struct Writer {
    pub(crate) shared: Arc<Shared>,
    api: Api<DynamicObject>,
    /// The pod's Kubernetes namespace, where the resource lives.
    namespace: String,
    name: String,
    owner: PodRef,
    controller: bool,
    table: tokio::sync::Mutex<BTreeMap<ChannelId, Entry>>,
    /// Serials of dropped guards, and whether the resource must be re-applied.
    pending: Mutex<(Vec<(ChannelId, u64)>, bool)>,
    wake: Notify,
    next_serial: AtomicU64,
    closed: AtomicBool,
    pub(crate) shutdown: CancellationToken,
}

#[derive(Debug, Clone)]
struct Entry {
    serial: u64,
    written: Written,
}

impl Writer {
    pub(crate) fn new(shared: Arc<Shared>, pod: &PodIdentity) -> Writer {
        let api = Api::namespaced_with(
            shared.client.clone(),
            &pod.namespace,
            &Shared::api_resource(),
        );
        Writer {
            shared,
            api,
            namespace: pod.namespace.clone(),
            name: pod.resource_name(),
            owner: PodRef {
                name: pod.name.clone(),
                uid: pod.uid.clone(),
            },
            controller: pod.container.is_none(),
            table: tokio::sync::Mutex::new(BTreeMap::new()),
            pending: Mutex::new((Vec::new(), false)),
            wake: Notify::new(),
            next_serial: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            shutdown: CancellationToken::new(),
        }
    }

    /// The resource's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Container mode: deletes a resource an earlier incarnation left (absent is fine),
    /// only when this pod owns it, or an earlier pod of its name (a StatefulSet's). Container-mode names (`{pod}-{container}`, Dynamo's
    /// rule) can collide (pod `a-b` with container `c`, pod `a` with container `b-c`):
    /// a resource of that name owned by another pod is left alone and this process
    /// refuses to register (`InvalidConfig`, naming the other pod), instead of deleting
    /// and overwriting another tenant's workers.
    pub(crate) async fn delete_stale(&self) -> Result<(), DiscoveryError> {
        let timeout = self.shared.config.request_timeout;
        let read = within("get", &self.namespace, timeout, async {
            let request = kube::core::Request::new(self.api.resource_url())
                .get(&self.name, &kube::api::GetParams::default())
                .map_err(kube::Error::BuildRequest)?;
            self.answer(request).await
        })
        .await;
        let text = match read {
            Err(e) if has_status(&e, 404) => return Ok(()),
            other => other?,
        };
        let found = narrow::resource(&text, &self.shared.config.limits);
        // This pod's, or its name's earlier pod's (names are unique in a namespace: a
        // pod of this name with another uid is gone, its resource awaiting collection).
        let ours = found
            .owner
            .as_ref()
            .is_some_and(|o| o.uid == self.owner.uid || o.name == self.owner.name);
        if !ours {
            let other = found.owner.map_or_else(|| "no pod".to_owned(), |o| o.name);
            return Err(DiscoveryError::InvalidConfig(ConfigError::Invalid {
                field: "pod",
                reason: format!(
                    "resource {}/{} is owned by {other}, not this pod ({}): container-mode \
                     names collide (`{{pod}}-{{container}}`); rename the pod or container",
                    self.namespace, self.name, self.owner.name
                ),
            }));
        }
        // Only the version read: a resource written since is not this one's to drop.
        let params = DeleteParams {
            preconditions: found.version.map(|v| kube::api::Preconditions {
                resource_version: Some(v),
                uid: None,
            }),
            ..DeleteParams::default()
        };
        let deleted = within("delete", &self.namespace, timeout, async {
            let request = kube::core::Request::new(self.api.resource_url())
                .delete(&self.name, &params)
                .map_err(kube::Error::BuildRequest)?;
            // The answer (the object or a status) is not read, only its status.
            self.answer(request).await.map(drop)
        })
        .await;
        match deleted {
            Err(e) if has_status(&e, 404) => Ok(()),
            other => other.map(|_| ()),
        }
    }

    /// Removes `id` from `table` if registration `serial` still owns it.
    fn remove_owned(
        &self,
        table: &mut BTreeMap<ChannelId, Entry>,
        id: &ChannelId,
        serial: u64,
    ) -> bool {
        if table.get(id).map(|e| e.serial) != Some(serial) {
            return false;
        }
        table.remove(id);
        self.shared
            .counters
            .registrations
            .fetch_sub(1, Ordering::Relaxed);
        true
    }

    /// Applies the whole resource; returns its new resourceVersion as an integer.
    async fn apply(&self, table: &BTreeMap<ChannelId, Entry>) -> Result<u64, DiscoveryError> {
        let body = ApplyBody::new(
            &self.name,
            &self.owner,
            self.controller,
            table.values().map(|e| &e.written),
        );
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let applied = within(
            "apply",
            &self.namespace,
            self.shared.config.request_timeout,
            async {
                let request = kube::core::Request::new(self.api.resource_url())
                    .patch(&self.name, &params, &Patch::Apply(&body))
                    .map_err(kube::Error::BuildRequest)?;
                self.answer(request).await
            },
        )
        .await?;
        // Only its version is read: what else the resource holds (another writer's
        // fields, however deep or large) costs its text and nothing more.
        narrow::version_of(&applied)
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|v| *v > 0)
            .ok_or_else(|| {
                DiscoveryError::Unavailable(
                    "the API server answered the apply without a positive integer resourceVersion"
                        .into(),
                )
            })
    }

    /// The server's answer to `request`, read within `max_page_bytes`.
    async fn answer(&self, request: http::Request<Vec<u8>>) -> Result<String, kube::Error> {
        let body = super::capped::send(&self.shared.client, request).await?;
        narrow::read_capped(body, self.shared.config.limits.max_page_bytes)
            .await
            .map_err(kube::Error::ReadEvents)
    }

    /// Registers `id` → `transport` for `worker` (or the configured one), with the
    /// worker's `recovery` endpoint (written only beside a worker).
    pub(crate) async fn register(
        self: &Arc<Self>,
        id: ChannelId,
        transport: Transport,
        worker: Option<WorkerIdentity>,
        recovery: Option<String>,
    ) -> Result<(Instance, u64), DiscoveryError> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(DiscoveryError::Closed);
        }
        let records = match worker {
            Some(w) => self
                .shared
                .config
                .records
                .clone()
                .worker(w.worker_id, w.dp_rank),
            None => self.shared.config.records.clone(),
        };
        if records.endpoint.is_none() {
            return Err(DiscoveryError::InvalidConfig(ConfigError::Invalid {
                field: "records",
                reason: "registering needs a Dynamo endpoint (DynamoRecords::endpoint)".to_owned(),
            }));
        }
        let worker = worker.or_else(|| {
            records
                .worker
                .map(|(worker_id, dp_rank)| WorkerIdentity::new(worker_id, dp_rank))
        });
        let written = written(&records, &id, &transport, recovery.as_deref())?;
        let serial = self.next_serial.fetch_add(1, Ordering::Relaxed);
        let mut table = self.table.lock().await;
        if self.closed.load(Ordering::Relaxed) {
            return Err(DiscoveryError::Closed);
        }
        let previous = table.insert(id.clone(), Entry { serial, written });
        // Dropped before the apply answered: roll back and re-apply in the background.
        let mut rollback = Rollback {
            writer: self,
            table,
            id: id.clone(),
            previous,
            armed: true,
        };
        let applied = self.apply(&rollback.table).await;
        match applied {
            Ok(version) => {
                rollback.armed = false;
                if rollback.previous.is_none() {
                    self.shared
                        .counters
                        .registrations
                        .fetch_add(1, Ordering::Relaxed);
                }
                let mut instance = Instance::new(id, transport, version);
                if let Some(w) = worker {
                    instance = instance.with_worker(w);
                    instance.recovery = recovery;
                }
                Ok((instance, serial))
            }
            Err(e) => {
                // Rolled back; the apply may still have landed (a timeout, a lost
                // answer), so the background task re-applies the table.
                drop(rollback);
                Err(e)
            }
        }
    }

    /// Removes `id` if `serial` still owns it and re-applies.
    pub(crate) async fn unregister(
        &self,
        id: &ChannelId,
        serial: u64,
    ) -> Result<(), DiscoveryError> {
        let mut table = self.table.lock().await;
        if !self.remove_owned(&mut table, id, serial) {
            return Ok(());
        }
        if self.closed.load(Ordering::Relaxed) {
            return Ok(());
        }
        // Gone locally: should this future be dropped part-way or the apply fail, the
        // background task applies the table until it holds.
        let mut reapply = Reapply(self, true);
        let applied = self.apply(&table).await;
        reapply.1 = applied.is_err();
        drop(reapply);
        applied.map(|_| ())
    }

    /// From `Drop` (never blocks): removes `id` in the background.
    pub(crate) fn release(&self, id: ChannelId, serial: u64) {
        self.signal(Some((id, serial)));
    }

    fn signal(&self, release: Option<(ChannelId, u64)>) {
        {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            match release {
                Some(r) => pending.0.push(r),
                None => pending.1 = true,
            }
        }
        self.wake.notify_one();
    }

    /// Applies the resource with every map empty (Dynamo's shutdown; the resource is
    /// not deleted). Registration guards alive become inert.
    pub(crate) async fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        self.shutdown.cancel();
        let mut table = self.table.lock().await;
        let held = table.len();
        table.clear();
        self.shared
            .counters
            .registrations
            .fetch_sub(held, Ordering::Relaxed);
        match self.apply(&table).await {
            Ok(_) => debug!(resource = %self.name, "applied with every map empty"),
            Err(e) => {
                warn!(resource = %self.name, error = %crate::net::ErrorChain(&e), "could not empty the resource on close")
            }
        }
    }

    /// The background task: removes released registrations and re-applies until the
    /// resource holds what the table says.
    pub(crate) async fn run(self: Arc<Self>) {
        let mut backoff = self.shared.backoff();
        let mut dirty = false;
        loop {
            if !dirty {
                tokio::select! {
                    () = self.shutdown.cancelled() => {
                        // The last handle went (perhaps with a guard whose release is
                        // still pending): apply what is left, once.
                        self.settle_once().await;
                        return;
                    }
                    () = self.wake.notified() => {}
                }
            }
            let (released, reapply) = {
                let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
                let reapply = std::mem::take(&mut pending.1);
                (std::mem::take(&mut pending.0), reapply)
            };
            let mut table = self.table.lock().await;
            let mut changed = dirty || reapply;
            for (id, serial) in released {
                changed |= self.remove_owned(&mut table, &id, serial);
            }
            if !changed || self.closed.load(Ordering::Relaxed) {
                dirty = false;
                continue;
            }
            match self.apply(&table).await {
                Ok(_) => {
                    dirty = false;
                    backoff = self.shared.backoff();
                }
                Err(e) => {
                    drop(table);
                    dirty = true;
                    debug!(error = %crate::net::ErrorChain(&e), "re-applying the resource failed; retrying");
                    let delay = backoff.next_delay(random_unit());
                    tokio::select! {
                        () = self.shutdown.cancelled() => return,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }
}

impl Writer {
    /// Removes pending releases and applies the table once (best effort).
    async fn settle_once(&self) {
        let released = {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            std::mem::take(&mut pending.0)
        };
        if released.is_empty() || self.closed.load(Ordering::Relaxed) {
            return;
        }
        let mut table = self.table.lock().await;
        for (id, serial) in released {
            self.remove_owned(&mut table, &id, serial);
        }
        if let Err(e) = self.apply(&table).await {
            debug!(error = %crate::net::ErrorChain(&e), "could not withdraw released registrations at shutdown");
        }
    }
}

fn written(
    records: &DynamoRecords,
    id: &ChannelId,
    transport: &Transport,
    recovery: Option<&str>,
) -> Result<Written, DiscoveryError> {
    Written::new(records, id, transport, recovery).map_err(|e| DiscoveryError::InvalidId {
        reason: e.to_string(),
    })
}

/// Asks the background task to re-apply the table when dropped armed (an unregister
/// dropped part-way, or whose apply failed).
struct Reapply<'a>(&'a Writer, bool);

impl Drop for Reapply<'_> {
    fn drop(&mut self) {
        if self.1 {
            self.0.signal(None);
        }
    }
}

/// Puts the table back as it was before a `register` whose future was dropped (or
/// whose apply failed).
struct Rollback<'a> {
    writer: &'a Writer,
    table: tokio::sync::MutexGuard<'a, BTreeMap<ChannelId, Entry>>,
    id: ChannelId,
    previous: Option<Entry>,
    armed: bool,
}

impl Rollback<'_> {
    fn restore(&mut self) {
        match self.previous.take() {
            Some(p) => {
                self.table.insert(self.id.clone(), p);
            }
            None => {
                self.table.remove(&self.id);
            }
        }
    }
}

impl Drop for Rollback<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.restore();
            // The apply may have landed: make the resource match the table again.
            self.writer.signal(None);
        }
    }
}
