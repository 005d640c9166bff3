//! The session task: lease keep-alive, re-grant when etcd reports the lease lost, and
//! the work guards and dropped futures signal.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use etcd_client::{LeaseKeepAliveStream, LeaseKeeper};
use tracing::{debug, info, warn};

use super::error::is_lease_not_found;
use super::shared::{EtcdState, Shared};
use crate::discovery::DiscoveryError;
use crate::net::random_unit;

/// What one keep-alive round found.
pub(super) enum KeepAlive {
    Alive,
    Lost,
}

/// The session task: lease keep-alive and re-grant, plus signalled work.
pub(super) struct Maintainer {
    pub(super) shared: Arc<Shared>,
    pub(super) keeper: Option<(LeaseKeeper, LeaseKeepAliveStream, i64)>,
}

impl Maintainer {
    pub(super) async fn run(mut self) {
        let shared = Arc::clone(&self.shared);
        let mut backoff = shared.backoff();
        let mut next = tokio::time::Instant::now() + shared.config.keepalive_every();
        loop {
            tokio::select! {
                biased;
                () = shared.shutdown.cancelled() => break,
                () = shared.wake.notified() => {
                    if let Err(e) = shared.process_pending().await {
                        debug!(error = %crate::net::ErrorChain(&e), "deferred etcd work failed; retrying with the keep-alive");
                    }
                }
                () = tokio::time::sleep_until(next) => {
                    let outcome = match self.keep_alive().await {
                        Err(e) if is_lease_not_found(&e) => Ok(KeepAlive::Lost),
                        other => other,
                    };
                    let healthy = match outcome {
                        Ok(KeepAlive::Alive) => true,
                        Ok(KeepAlive::Lost) => {
                            self.keeper = None;
                            let mut session = shared.session.lock().await;
                            match shared.regrant(&mut session).await {
                                Ok(()) => true,
                                Err(e) => {
                                    warn!(error = %crate::net::ErrorChain(&e), "could not re-grant the etcd lease");
                                    false
                                }
                            }
                        }
                        Err(e) => {
                            self.keeper = None;
                            if let Some(suppressed) =
                                shared.warn.check("keepalive", std::time::Instant::now())
                            {
                                warn!(error = %crate::net::ErrorChain(&e), suppressed, "etcd keep-alive failed; reconnecting");
                            }
                            false
                        }
                    };
                    if healthy {
                        if shared.state.borrow().eq(&EtcdState::Reconnecting) {
                            info!("etcd session live again");
                        }
                        shared.set_state(EtcdState::Live);
                        backoff.reset();
                        if let Err(e) = shared.process_pending().await {
                            debug!(error = %crate::net::ErrorChain(&e), "deferred etcd work failed");
                        }
                        next = tokio::time::Instant::now() + shared.config.keepalive_every();
                    } else {
                        shared.set_state(EtcdState::Reconnecting);
                        let delay = backoff
                            .next_delay(random_unit())
                            .max(shared.config.backoff_min)
                            .min(shared.config.keepalive_every());
                        next = tokio::time::Instant::now() + delay;
                    }
                }
            }
        }
        // Best effort: carry out drops that raced the shutdown, then give the lease
        // back if nothing is left on it (after `close` it is already revoked).
        let _ = shared.process_pending().await;
        let session = shared.session.lock().await;
        if session.regs.is_empty() && !shared.closed.load(Ordering::Relaxed) {
            let mut lease = shared.client.lease_client();
            let _ = shared
                .request("lease revoke", lease.revoke(session.lease))
                .await;
        }
    }

    async fn keep_alive(&mut self) -> Result<KeepAlive, DiscoveryError> {
        let shared = Arc::clone(&self.shared);
        let lease = shared.lease_id.load(Ordering::Relaxed);
        if self.keeper.as_ref().is_none_or(|k| k.2 != lease) {
            let mut client = shared.client.lease_client();
            let (keeper, stream) = shared
                .request("lease keep-alive", client.keep_alive(lease))
                .await?;
            self.keeper = Some((keeper, stream, lease));
        }
        let Some((keeper, stream, _)) = self.keeper.as_mut() else {
            return Ok(KeepAlive::Lost);
        };
        shared
            .request("lease keep-alive", keeper.keep_alive())
            .await?;
        match shared.request("lease keep-alive", stream.message()).await? {
            Some(response) if response.ttl() > 0 => Ok(KeepAlive::Alive),
            Some(_) => Ok(KeepAlive::Lost),
            None => Err(DiscoveryError::WatchEnded {
                reason: "etcd closed the keep-alive stream".to_owned(),
            }),
        }
    }
}
