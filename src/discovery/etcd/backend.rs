//! `EtcdDiscovery` as a [`Discovery`] backend: register, list, watch, and the
//! registration guard.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio_util::sync::CancellationToken;

use super::registry::SignalOnDrop;
use super::table::{PendingKind, PendingOp};
use super::{EtcdDiscovery, Handle, watch};
use crate::BoxFuture;
use crate::discovery::{
    ChannelId, Discovery, DiscoveryError, DiscoveryStats, DiscoveryStream, Instance, Query,
    Registration, RegistrationHandle, Transport, WorkerIdentity,
};

impl Discovery for EtcdDiscovery {
    fn register_with(
        &self,
        id: ChannelId,
        transport: Transport,
        worker: Option<WorkerIdentity>,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        self.register_instance(Instance {
            worker,
            ..Instance::new(id, transport, 0)
        })
    }

    fn register_instance(
        &self,
        instance: Instance,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        let (id, transport, worker, recovery) = instance.into_registered();
        Box::pin(async move {
            if self.handle.shared.shutdown.is_cancelled() {
                return Err(DiscoveryError::Closed);
            }
            let (instance, serial) = self
                .handle
                .shared
                .register(id, transport, worker, recovery)
                .await?;
            let guard = EtcdRegistration {
                handle: Arc::clone(&self.handle),
                id: instance.id.clone(),
                serial,
            };
            Ok(Registration::new(instance, Box::new(guard)))
        })
    }

    fn list(&self, query: Query) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>> {
        Box::pin(async move {
            let shared = &self.handle.shared;
            let prefix = shared.keys.query_prefix(&query);
            Ok(shared.snapshot(&prefix, &query).await?.1)
        })
    }

    fn watch(
        &self,
        query: Query,
        cancel: CancellationToken,
    ) -> BoxFuture<'_, Result<DiscoveryStream, DiscoveryError>> {
        Box::pin(watch::start(Arc::clone(&self.handle.shared), query, cancel))
    }

    fn stats(&self) -> DiscoveryStats {
        let c = &self.handle.shared.counters;
        let mut stats = DiscoveryStats {
            registrations: c.registrations.load(Ordering::Relaxed),
            malformed: c.malformed.load(Ordering::Relaxed),
            lease_losses: c.lease_losses.load(Ordering::Relaxed),
            reconnects: c.reconnects.load(Ordering::Relaxed),
            ..DiscoveryStats::default()
        };
        c.watch.fill(&mut stats);
        stats
    }
}

/// The guard behind an etcd [`Registration`].
struct EtcdRegistration {
    handle: Arc<Handle>,
    id: ChannelId,
    serial: u64,
}

impl fmt::Debug for EtcdRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdRegistration")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl RegistrationHandle for EtcdRegistration {
    fn unregister(self: Box<Self>) -> BoxFuture<'static, Result<(), DiscoveryError>> {
        // Dropped before it took the registration out of the table (even unpolled),
        // this future releases it as a dropped guard would. From there on
        // `Shared::unregister` sees the delete through, retrying a failure in the
        // background.
        let release = SignalOnDrop::arm(
            &self.handle.shared,
            PendingOp {
                id: self.id.clone(),
                serial: self.serial,
                kind: PendingKind::Release,
            },
        );
        Box::pin(async move {
            let result = self.handle.shared.unregister(&self.id, self.serial).await;
            release.disarm();
            result
        })
    }

    fn release(self: Box<Self>) {
        self.handle.shared.signal(PendingOp {
            id: self.id.clone(),
            serial: self.serial,
            kind: PendingKind::Release,
        });
    }

    fn detach(self: Box<Self>) {
        self.handle.shared.signal(PendingOp {
            id: self.id.clone(),
            serial: self.serial,
            kind: PendingKind::Detach,
        });
    }
}
