//! The state every task of one `EtcdDiscovery` shares: the client, the registration
//! session, the counters, and the reads they all use (requests with deadlines, paged
//! snapshots).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, GetOptions};
use tokio::sync::{Notify, watch as state_watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::config::EtcdConfig;
use super::error::{EtcdRequestError, failed, unavailable};
use super::record::{Keys, prefix_end};

/// The recovery endpoints Dynamo's `event_sources` records name, by publisher.
pub(crate) type Sources = std::collections::HashMap<crate::discovery::ChannelId, String>;
use super::table::{PendingOp, Session};
use crate::discovery::backlog::WatchCounters;
use crate::discovery::records::RecordError;
use crate::discovery::{DiscoveryError, Instance, Query};
use crate::net::{Backoff, RateLimitedWarn};

/// Whether an [`EtcdDiscovery`](super::EtcdDiscovery)'s session with etcd is healthy.
///
/// ```
/// use eventplane::discovery::EtcdState;
/// assert_ne!(EtcdState::Live, EtcdState::Reconnecting);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EtcdState {
    /// The lease was renewed within the last keep-alive period: registrations are up.
    Live,
    /// The last keep-alive failed; the backend is retrying with backoff. Registrations
    /// survive while etcd keeps the lease (its TTL); if it was lost, they are put again
    /// under a new lease on reconnect.
    Reconnecting,
}

pub(crate) struct Shared {
    pub(super) client: Client,
    pub(super) config: EtcdConfig,
    pub(super) keys: Keys,
    /// Serializes everything that touches the lease or the registration table:
    /// registers, unregisters, lease re-grants.
    pub(super) session: tokio::sync::Mutex<Session>,
    /// The current lease id (mirror of `session.lease`, readable without locking).
    pub(super) lease_id: AtomicI64,
    /// Work signalled from synchronous code (guard drops, detaches).
    pub(super) pending: Mutex<Vec<PendingOp>>,
    pub(super) wake: Notify,
    pub(super) state: state_watch::Sender<EtcdState>,
    pub(super) shutdown: CancellationToken,
    /// `close` revoked the lease.
    pub(super) closed: AtomicBool,
    pub(super) next_serial: AtomicU64,
    pub(crate) counters: Counters,
    pub(crate) warn: RateLimitedWarn,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(super) registrations: AtomicUsize,
    pub(crate) watch: Arc<WatchCounters>,
    pub(crate) malformed: AtomicU64,
    pub(super) lease_losses: AtomicU64,
    pub(crate) reconnects: AtomicU64,
}

impl Shared {
    pub(super) fn endpoints(&self) -> String {
        self.config.endpoints.join(",")
    }

    /// Runs one request with the request timeout, wrapping failures.
    pub(crate) async fn request<T, F>(&self, op: &'static str, fut: F) -> Result<T, DiscoveryError>
    where
        F: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.request_within(op, self.config.request_timeout, fut)
            .await
    }

    pub(super) async fn request_within<T, F>(
        &self,
        op: &'static str,
        after: Duration,
        fut: F,
    ) -> Result<T, DiscoveryError>
    where
        F: Future<Output = Result<T, etcd_client::Error>>,
    {
        match tokio::time::timeout(after, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(source)) => Err(failed(op, self.endpoints(), source)),
            Err(_) => Err(unavailable(EtcdRequestError::TimedOut {
                op,
                endpoints: self.endpoints(),
                after,
            })),
        }
    }

    pub(crate) fn keys(&self) -> &Keys {
        &self.keys
    }

    pub(crate) fn config_watch_buffer(&self) -> usize {
        self.config.watch_buffer
    }

    pub(crate) fn backoff(&self) -> Backoff {
        Backoff::checked(self.config.backoff_min, self.config.backoff_max)
    }

    pub(crate) fn client(&self) -> Client {
        self.client.clone()
    }

    /// Counts and logs (rate-limited) a skipped record.
    pub(crate) fn skipped(&self, key: &[u8], err: &RecordError) {
        self.counters.malformed.fetch_add(1, Ordering::Relaxed);
        if let Some(suppressed) = self.warn.check("malformed", std::time::Instant::now()) {
            warn!(
                key = %String::from_utf8_lossy(key.get(..key.len().min(256)).unwrap_or_default()),
                error = %err,
                suppressed,
                "skipping a malformed discovery record"
            );
        }
    }

    /// Reads every key under `prefix` at one revision, page by page, keeping those
    /// `query` matches. Returns the revision and the instances.
    pub(crate) async fn snapshot(
        &self,
        prefix: &str,
        query: &Query,
    ) -> Result<(i64, Vec<Instance>), DiscoveryError> {
        let (revision, out, _) = self.snapshot_with_sources(prefix, query).await?;
        Ok((revision, out))
    }

    /// As [`snapshot`](Self::snapshot), with the recovery endpoints of Dynamo's
    /// `event_sources` records read at the same revision (set on their instances, and
    /// returned for the watch that follows).
    pub(crate) async fn snapshot_with_sources(
        &self,
        prefix: &str,
        query: &Query,
    ) -> Result<(i64, Vec<Instance>, Sources), DiscoveryError> {
        let end = prefix_end(prefix.as_bytes());
        let mut restarts = 0;
        'restart: loop {
            let mut out = Vec::new();
            let mut sources = Sources::default();
            let mut revision = 0i64;
            let mut from = prefix.as_bytes().to_vec();
            let mut page = self.config.page_size;
            loop {
                let mut options = GetOptions::new()
                    .with_range(end.clone())
                    .with_limit(i64::try_from(page).unwrap_or(i64::MAX));
                if revision > 0 {
                    options = options.with_revision(revision);
                }
                let mut kv = self.client.kv_client();
                let response = match tokio::time::timeout(
                    self.config.request_timeout,
                    kv.get(from.clone(), Some(options)),
                )
                .await
                {
                    Ok(Ok(r)) => r,
                    Ok(Err(e)) => {
                        let text = e.to_string();
                        if text.contains("message length too large") && page > 1 {
                            page = (page / 4).max(1);
                            debug!(page, "etcd page too large, retrying smaller");
                            continue;
                        }
                        if text.contains("compacted") && revision > 0 && restarts < 5 {
                            restarts += 1;
                            continue 'restart;
                        }
                        return Err(failed("range", self.endpoints(), e));
                    }
                    Err(_) => {
                        return Err(unavailable(EtcdRequestError::TimedOut {
                            op: "range",
                            endpoints: self.endpoints(),
                            after: self.config.request_timeout,
                        }));
                    }
                };
                if revision == 0 {
                    revision = response
                        .header()
                        .map(|h| h.revision())
                        .ok_or_else(|| unavailable(EtcdRequestError::NoHeader { op: "range" }))?;
                }
                let kvs = response.kvs();
                for kv in kvs {
                    let max = self.config.max_value_bytes;
                    match self.keys.source(kv.key(), Some(kv.value()), max) {
                        Some(Ok((id, Some(recovery)))) if query.matches(&id) => {
                            sources.insert(id, recovery);
                            continue;
                        }
                        Some(Ok(_)) => continue,
                        Some(Err(e)) => {
                            self.skipped(kv.key(), &e);
                            continue;
                        }
                        None => {}
                    }
                    match self.keys.parse(
                        kv.key(),
                        kv.value(),
                        kv.mod_revision(),
                        self.config.max_value_bytes,
                    ) {
                        Ok(Some(instance)) if query.matches(&instance.id) => out.push(instance),
                        Ok(_) => {}
                        Err(e) => self.skipped(kv.key(), &e),
                    }
                }
                match kvs.last() {
                    Some(last) if response.more() => {
                        from = last.key().to_vec();
                        from.push(0);
                    }
                    _ => {
                        for instance in &mut out {
                            if let Some(recovery) = sources.get(&instance.id) {
                                instance.recovery = Some(recovery.clone());
                            }
                        }
                        return Ok((revision, out, sources));
                    }
                }
            }
        }
    }

    pub(super) fn set_state(&self, state: EtcdState) {
        self.state.send_if_modified(|s| {
            let changed = *s != state;
            *s = state;
            changed
        });
    }
}
