//! A watch that restarts itself: what every long-running consumer of discovery (the
//! dynamic subscriber, the tunnel broker's view) needs around [`Discovery::watch`].

use std::pin::Pin;
use std::sync::Arc;

use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;

use super::{BoxFuture, Discovery, DiscoveryError, DiscoveryEvent, DiscoveryStream, Query};
use crate::net::{Backoff, random_unit};

/// What a [`Rewatch`] yields.
#[derive(Debug)]
pub(crate) enum Rewatched {
    /// An event of the current watch.
    Event(DiscoveryEvent),
    /// The `watch` call failed; another follows after the backoff.
    Failed(DiscoveryError),
    /// The current watch failed (`Some`) or ended (`None`); a new one follows after
    /// the backoff, starting with its own initial list.
    Ended(Option<DiscoveryError>),
}

enum State {
    Connecting(BoxFuture<'static, Result<DiscoveryStream, DiscoveryError>>),
    Watching(DiscoveryStream),
    Waiting(Pin<Box<Sleep>>),
}

/// Watches `query` until cancelled: a failed `watch` call, a stream error or a stream
/// end is reported and followed by a new watch after a jittered backoff, which a
/// `Resync` resets. [`next`](Self::next) is cancel-safe: a caller may `select!` on it
/// beside its own timers.
pub(crate) struct Rewatch {
    discovery: Arc<dyn Discovery>,
    query: Query,
    cancel: CancellationToken,
    backoff: Backoff,
    state: State,
}

impl Rewatch {
    /// Starts the first watch at once.
    pub(crate) fn new(
        discovery: Arc<dyn Discovery>,
        query: Query,
        backoff: Backoff,
        cancel: CancellationToken,
    ) -> Rewatch {
        let state = State::Connecting(connect(&discovery, &query, &cancel));
        Rewatch {
            discovery,
            query,
            cancel,
            backoff,
            state,
        }
    }

    /// The next event or failure; `None` once cancelled.
    pub(crate) async fn next(&mut self) -> Option<Rewatched> {
        loop {
            let Rewatch {
                discovery,
                query,
                cancel,
                backoff,
                state,
            } = self;
            let (next_state, item) = match state {
                State::Connecting(watch) => tokio::select! {
                    () = cancel.cancelled() => return None,
                    r = watch.as_mut() => match r {
                        Ok(stream) => (State::Watching(stream), None),
                        Err(e) => (wait(backoff), Some(Rewatched::Failed(e))),
                    },
                },
                State::Watching(stream) => tokio::select! {
                    () = cancel.cancelled() => return None,
                    event = stream.next() => match event {
                        Some(Ok(event)) => {
                            if matches!(event, DiscoveryEvent::Resync(_)) {
                                backoff.reset();
                            }
                            return Some(Rewatched::Event(event));
                        }
                        Some(Err(e)) => (wait(backoff), Some(Rewatched::Ended(Some(e)))),
                        None => (wait(backoff), Some(Rewatched::Ended(None))),
                    },
                },
                State::Waiting(sleep) => tokio::select! {
                    () = cancel.cancelled() => return None,
                    () = sleep.as_mut() => (State::Connecting(connect(discovery, query, cancel)), None),
                },
            };
            *state = next_state;
            if item.is_some() {
                return item;
            }
        }
    }
}

fn connect(
    discovery: &Arc<dyn Discovery>,
    query: &Query,
    cancel: &CancellationToken,
) -> BoxFuture<'static, Result<DiscoveryStream, DiscoveryError>> {
    let (discovery, query, cancel) = (discovery.clone(), query.clone(), cancel.child_token());
    Box::pin(async move { discovery.watch(query, cancel).await })
}

fn wait(backoff: &mut Backoff) -> State {
    State::Waiting(Box::pin(tokio::time::sleep(
        backoff.next_delay(random_unit()),
    )))
}

#[cfg(all(test, feature = "test-support"))]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use std::time::Duration;

    use super::*;
    use crate::discovery::{ChannelId, FaultDiscovery, MemoryDiscovery, Transport};

    #[tokio::test(start_paused = true)]
    async fn failures_are_reported_and_followed_by_a_new_watch() {
        let memory = Arc::new(MemoryDiscovery::new());
        let (discovery, faults) = FaultDiscovery::new(memory.clone());
        faults.fail_next_watch_calls(1);
        let backoff = Backoff::checked(Duration::from_millis(100), Duration::from_secs(1));
        let mut rewatch = Rewatch::new(
            Arc::new(discovery),
            Query::new("ns"),
            backoff,
            CancellationToken::new(),
        );
        assert!(matches!(rewatch.next().await, Some(Rewatched::Failed(_))));
        assert!(matches!(
            rewatch.next().await,
            Some(Rewatched::Event(DiscoveryEvent::Resync(_)))
        ));
        let _reg = memory
            .register(
                ChannelId::new("ns", "c", "t", 1).unwrap(),
                Transport::zmq("tcp://127.0.0.1:1"),
            )
            .await
            .unwrap();
        assert!(matches!(
            rewatch.next().await,
            Some(Rewatched::Event(DiscoveryEvent::Added(_)))
        ));
        faults.fail_watches("injected");
        assert!(matches!(
            rewatch.next().await,
            Some(Rewatched::Ended(Some(_)))
        ));
        // The new watch starts with its initial list.
        assert!(matches!(
            rewatch.next().await,
            Some(Rewatched::Event(DiscoveryEvent::Added(_)))
        ));
        assert!(matches!(
            rewatch.next().await,
            Some(Rewatched::Event(DiscoveryEvent::Resync(_)))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_rewatch_ends_even_while_waiting() {
        let (discovery, faults) = FaultDiscovery::new(Arc::new(MemoryDiscovery::new()));
        faults.fail_next_watch_calls(1);
        let cancel = CancellationToken::new();
        let backoff = Backoff::checked(Duration::from_secs(60), Duration::from_secs(60));
        let mut rewatch = Rewatch::new(
            Arc::new(discovery),
            Query::new("ns"),
            backoff,
            cancel.clone(),
        );
        assert!(matches!(rewatch.next().await, Some(Rewatched::Failed(_))));
        cancel.cancel();
        assert!(rewatch.next().await.is_none());
    }
}
