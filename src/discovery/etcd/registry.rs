//! Registrations: the etcd requests that register, unregister, detach and re-grant,
//! kept in step with the local table (`table.rs`).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use tracing::{debug, warn};

use super::error::{EtcdRequestError, is_lease_not_found, unavailable};
use super::record::Entry;
use super::shared::Shared;
use super::table::{LocalReg, PendingKind, PendingOp, Session};
use crate::discovery::{ChannelId, DiscoveryError, Instance, Transport, WorkerIdentity};

/// Hands its op to the session task if dropped before [`disarm`](Self::disarm): how a
/// request whose future may be dropped part-way (or that failed without telling
/// whether etcd applied it) is finished in the background. Dropping only signals: it
/// never blocks or spawns.
#[must_use = "dropping the guard signals its clean-up at once"]
pub(super) struct SignalOnDrop {
    pub(super) shared: Arc<Shared>,
    pub(super) op: Option<PendingOp>,
}

impl SignalOnDrop {
    pub(super) fn arm(shared: &Arc<Shared>, op: PendingOp) -> SignalOnDrop {
        SignalOnDrop {
            shared: Arc::clone(shared),
            op: Some(op),
        }
    }

    /// The request completed: nothing is left to do.
    pub(super) fn disarm(mut self) {
        self.op = None;
    }
}

impl Drop for SignalOnDrop {
    fn drop(&mut self) {
        if let Some(op) = self.op.take() {
            self.shared.signal(op);
        }
    }
}

impl fmt::Debug for SignalOnDrop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SignalOnDrop")
            .field("op", &self.op)
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(super) fn signal(&self, op: PendingOp) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(op);
        self.wake.notify_one();
    }

    /// Puts `value` at `key` (and the companion record beside it, in the same
    /// transaction) under `lease`; returns the new `mod_revision`.
    pub(super) async fn put(
        &self,
        key: &str,
        value: &str,
        companion: Option<&(String, String)>,
        lease: i64,
    ) -> Result<i64, DiscoveryError> {
        let mut kv = self.client.kv_client();
        let header = match companion {
            None => self
                .request(
                    "put",
                    kv.put(key, value, Some(PutOptions::new().with_lease(lease))),
                )
                .await?
                .header()
                .cloned(),
            Some(_) => {
                let txn = Txn::new().and_then(put_ops(key, value, companion, lease));
                self.request("put", kv.txn(txn)).await?.header().cloned()
            }
        };
        header
            .map(|h| h.revision())
            .ok_or_else(|| unavailable(EtcdRequestError::NoHeader { op: "put" }))
    }

    /// Deletes `key` and the record beside it.
    fn delete_ops(&self, key: &str) -> Vec<TxnOp> {
        std::iter::once(key.to_owned())
            .chain(self.keys.companion_key(key))
            .map(|k| TxnOp::delete(k, None))
            .collect()
    }

    pub(super) async fn grant(&self) -> Result<i64, DiscoveryError> {
        let mut lease = self.client.lease_client();
        let response = self
            .request("lease grant", lease.grant(self.config.ttl_secs(), None))
            .await?;
        Ok(response.id())
    }

    /// Puts a new registration and records it. Cancel-safe: dropped while its put is in
    /// flight (or when the put fails without saying whether etcd applied it), it leaves
    /// an `Abandoned` clean-up to the session task; the registration enters the table
    /// only once the put landed, and the caller turns the result into its guard without
    /// another await.
    pub(super) async fn register(
        self: &Arc<Self>,
        id: ChannelId,
        transport: Transport,
        worker: Option<WorkerIdentity>,
        recovery: Option<String>,
    ) -> Result<(Instance, u64), DiscoveryError> {
        let Entry {
            key,
            value,
            companion,
        } = self
            .keys
            .entry(&id, &transport, worker, recovery.as_deref())?;
        let mut session = self.session.lock().await;
        if self.shutdown.is_cancelled() {
            // `close` revoked the lease while this waited: do not grant a new one.
            return Err(DiscoveryError::Closed);
        }
        // Taken under the lock, serials order the puts of one id as etcd applies them
        // (which `clean_abandoned` relies on).
        let serial = self.next_serial.fetch_add(1, Ordering::Relaxed);
        let (revision, cleanup) = match self
            .put_new(&id, serial, &key, &value, companion.as_ref(), session.lease)
            .await
        {
            Ok(done) => done,
            Err(e) if is_lease_not_found(&e) => {
                // The lease is gone: re-grant now (putting every registration again),
                // then retry once under the new lease.
                self.regrant(&mut session).await?;
                self.put_new(&id, serial, &key, &value, companion.as_ref(), session.lease)
                    .await?
            }
            Err(e) => return Err(e),
        };
        session.regs.insert(
            id.clone(),
            LocalReg {
                serial,
                key,
                value,
                companion,
                revision,
            },
        );
        // In the table: from here on the guard the caller builds owns the key.
        cleanup.disarm();
        self.counters
            .registrations
            .store(session.regs.len(), Ordering::Relaxed);
        let incarnation = u64::try_from(revision).unwrap_or_default();
        debug!(%id, incarnation, "registered in etcd");
        let mut instance = Instance::new(id, transport, incarnation);
        instance.worker = worker;
        instance.recovery = recovery;
        Ok((instance, serial))
    }

    /// Puts a new registration's key under `lease`. Until the caller disarms the
    /// returned guard (once the registration is in the table), dropping this future or
    /// the guard signals an `Abandoned` clean-up. A refusal that proves nothing was
    /// applied (lease not found, denied, invalid) disarms it.
    pub(super) async fn put_new(
        self: &Arc<Self>,
        id: &ChannelId,
        serial: u64,
        key: &str,
        value: &str,
        companion: Option<&(String, String)>,
        lease: i64,
    ) -> Result<(i64, SignalOnDrop), DiscoveryError> {
        let cleanup = SignalOnDrop::arm(
            self,
            PendingOp {
                id: id.clone(),
                serial,
                kind: PendingKind::Abandoned {
                    key: key.to_owned(),
                    lease,
                    rechecked: false,
                },
            },
        );
        match self.put(key, value, companion, lease).await {
            Ok(revision) => Ok((revision, cleanup)),
            Err(e) if is_lease_not_found(&e) || !e.is_transient() => {
                cleanup.disarm();
                Err(e)
            }
            // A timeout or a lost connection: etcd may have applied the put.
            Err(e) => Err(e),
        }
    }

    /// Removes a registration and deletes its key. Cancel-safe: the registration
    /// leaves the table (so a lease re-grant no longer puts it back) before the delete
    /// is sent; dropped after that, or failing transiently, this leaves the delete to
    /// the session task.
    pub(super) async fn unregister(
        self: &Arc<Self>,
        id: &ChannelId,
        serial: u64,
    ) -> Result<(), DiscoveryError> {
        let mut session = self.session.lock().await;
        if session.regs.get(id).is_none_or(|r| r.serial != serial) {
            // Replaced by a newer registration of the same id: nothing to remove.
            return Ok(());
        }
        let Some(reg) = session.regs.remove(id) else {
            return Ok(());
        };
        self.counters
            .registrations
            .store(session.regs.len(), Ordering::Relaxed);
        let cleanup = SignalOnDrop::arm(
            self,
            PendingOp {
                id: id.clone(),
                serial,
                kind: PendingKind::Delete {
                    key: reg.key.clone(),
                    revision: reg.revision,
                },
            },
        );
        match self.delete_incarnation(&reg.key, reg.revision).await {
            Ok(()) => cleanup.disarm(),
            Err(e) if !e.is_transient() => {
                // Retrying cannot help; the key expires with the lease once this
                // backend is closed or dropped.
                cleanup.disarm();
                return Err(e);
            }
            Err(e) => return Err(e),
        }
        drop(session);
        debug!(%id, "unregistered from etcd");
        Ok(())
    }

    /// Deletes `key` if it still holds the incarnation `revision`: another process, or
    /// a later registration, may have replaced it.
    pub(super) async fn delete_incarnation(
        &self,
        key: &str,
        revision: i64,
    ) -> Result<(), DiscoveryError> {
        let txn = Txn::new()
            .when([Compare::mod_revision(key, CompareOp::Equal, revision)])
            .and_then(self.delete_ops(key));
        let mut kv = self.client.kv_client();
        self.request("delete", kv.txn(txn)).await?;
        Ok(())
    }

    /// Takes back what an abandoned `register` of `id` (serial `serial`, put under
    /// `lease`) may have left. `Ok(true)` when it found no trace of the put, which may
    /// also mean that etcd has not applied it yet: worth a second look later.
    ///
    /// - A later registration of the id is in the table: the key is its. Nothing to do.
    /// - An earlier one is: the abandoned put may have overwritten its value. If the
    ///   key is on our lease but no longer at that registration's revision, its value
    ///   is put back (and its revision recorded), so its guard controls the key again.
    ///   After a re-grant, the re-grant already put it back.
    /// - None is: the key is deleted if it is on `lease` (so never another process's
    ///   key, nor a detached one).
    pub(super) async fn clean_abandoned(
        &self,
        id: &ChannelId,
        serial: u64,
        key: &str,
        lease: i64,
    ) -> Result<bool, DiscoveryError> {
        let mut session = self.session.lock().await;
        let current_lease = session.lease;
        let mut kv = self.client.kv_client();
        match session.regs.get_mut(id) {
            Some(reg) if reg.serial >= serial => Ok(false),
            // Our lease was lost since (with every key on it): nothing can land there.
            Some(_) if lease != current_lease => Ok(false),
            Some(reg) => {
                let txn = Txn::new()
                    .when([
                        Compare::lease(key, CompareOp::Equal, lease),
                        Compare::mod_revision(key, CompareOp::NotEqual, reg.revision),
                    ])
                    .and_then(put_ops(key, &reg.value, reg.companion.as_ref(), lease));
                let response = self.request("restore", kv.txn(txn)).await?;
                if !response.succeeded() {
                    return Ok(true);
                }
                reg.revision = response
                    .header()
                    .map(|h| h.revision())
                    .ok_or_else(|| unavailable(EtcdRequestError::NoHeader { op: "restore" }))?;
                debug!(%id, revision = reg.revision, "an abandoned re-registration was taken back");
                Ok(false)
            }
            None => {
                let txn = Txn::new()
                    .when([Compare::lease(key, CompareOp::Equal, lease)])
                    .and_then(self.delete_ops(key));
                let response = self.request("delete", kv.txn(txn)).await?;
                if response.succeeded() {
                    debug!(%id, "the key of an abandoned registration was deleted");
                }
                Ok(!response.succeeded())
            }
        }
    }

    /// Moves a registration to its own lease that is never renewed.
    pub(super) async fn detach(&self, id: &ChannelId, serial: u64) -> Result<(), DiscoveryError> {
        let mut session = self.session.lock().await;
        let Some(reg) = session.regs.get(id).filter(|r| r.serial == serial).cloned() else {
            return Ok(());
        };
        let orphan = self.grant().await?;
        let txn = Txn::new()
            .when([Compare::mod_revision(
                reg.key.clone(),
                CompareOp::Equal,
                reg.revision,
            )])
            .and_then(put_ops(
                &reg.key,
                &reg.value,
                reg.companion.as_ref(),
                orphan,
            ));
        let mut kv = self.client.kv_client();
        self.request("detach", kv.txn(txn)).await?;
        session.regs.remove(id);
        self.counters
            .registrations
            .store(session.regs.len(), Ordering::Relaxed);
        debug!(%id, lease = orphan, "detached: expires with its own lease");
        Ok(())
    }

    /// Grants a new lease and puts every live registration under it.
    pub(super) async fn regrant(&self, session: &mut Session) -> Result<(), DiscoveryError> {
        self.counters.lease_losses.fetch_add(1, Ordering::Relaxed);
        let lease = self.grant().await?;
        for (id, reg) in session.regs.iter_mut() {
            reg.revision = self
                .put(&reg.key, &reg.value, reg.companion.as_ref(), lease)
                .await?;
            debug!(%id, revision = reg.revision, "registration put again under the new lease");
        }
        session.lease = lease;
        self.lease_id.store(lease, Ordering::Relaxed);
        warn!(
            lease,
            registrations = session.regs.len(),
            "etcd lease was lost: granted a new one and put every registration again"
        );
        Ok(())
    }

    /// Carries out work signalled by guard drops, detaches and dropped futures. Work
    /// that failed transiently is kept for the next round; work that cannot succeed
    /// (refused credentials or permissions) is given up with a warning.
    pub(super) async fn process_pending(self: &Arc<Self>) -> Result<(), DiscoveryError> {
        let ops = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        let mut ops = ops.into_iter();
        let mut later = Vec::new();
        let mut outcome = Ok(());
        while let Some(op) = ops.next() {
            let result = match &op.kind {
                PendingKind::Release => self.unregister(&op.id, op.serial).await,
                PendingKind::Detach => self.detach(&op.id, op.serial).await,
                PendingKind::Delete { key, revision } => {
                    self.delete_incarnation(key, *revision).await
                }
                PendingKind::Abandoned {
                    key,
                    lease,
                    rechecked,
                } => match self.clean_abandoned(&op.id, op.serial, key, *lease).await {
                    // Nothing found: unless already looked at twice, look again next
                    // round, in case etcd applies the dropped put only now.
                    Ok(true) if !rechecked => {
                        later.push(PendingOp {
                            id: op.id.clone(),
                            serial: op.serial,
                            kind: PendingKind::Abandoned {
                                key: key.clone(),
                                lease: *lease,
                                rechecked: true,
                            },
                        });
                        Ok(())
                    }
                    other => other.map(|_| ()),
                },
            };
            match result {
                Ok(()) => {}
                Err(e) if !e.is_transient() => {
                    if let Some(suppressed) =
                        self.warn.check("pending-denied", std::time::Instant::now())
                    {
                        warn!(error = %crate::net::ErrorChain(&e), id = %op.id, suppressed, "giving up deferred etcd work");
                    }
                }
                Err(e) => {
                    later.push(op);
                    later.extend(ops);
                    outcome = Err(e);
                    break;
                }
            }
        }
        if !later.is_empty() {
            // Not signalled: kept for the next round (the next keep-alive, or wake-up).
            self.pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(later);
        }
        outcome
    }
}

/// Puts `value` at `key`, and the companion record beside it, under `lease`.
fn put_ops(key: &str, value: &str, companion: Option<&(String, String)>, lease: i64) -> Vec<TxnOp> {
    std::iter::once((key, value))
        .chain(companion.map(|(k, v)| (k.as_str(), v.as_str())))
        .map(|(k, v)| TxnOp::put(k, v, Some(PutOptions::new().with_lease(lease))))
        .collect()
}
