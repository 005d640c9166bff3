//! Making an [`IndexFeed`](crate::kv::IndexFeed)'s recoveries: bounded, rate-limited,
//! beside the feed.

use std::time::Duration;

use super::endpoint::{RecoveryClientConfig, RecoveryError, recover};
use crate::kv::{RecoveryAnswer, RecoveryNeed};

/// Recoveries made at once by a [`RecoveryDriver`] by default: 16.
///
/// ```
/// assert_eq!(eventplane::kv::DEFAULT_CONCURRENT_RECOVERIES, 16);
/// ```
pub const DEFAULT_CONCURRENT_RECOVERIES: usize = 16;

/// Shortest time between two recoveries of one publisher made by a
/// [`RecoveryDriver`]: 1 s (a publisher that keeps losing events is asked at most
/// once a second; its later losses wait).
///
/// ```
/// assert_eq!(eventplane::kv::RECOVERY_INTERVAL, std::time::Duration::from_secs(1));
/// ```
pub const RECOVERY_INTERVAL: Duration = Duration::from_secs(1);

/// Most recoveries a [`RecoveryDriver`] queues (beyond [`DEFAULT_CONCURRENT_RECOVERIES`]
/// running): 4,096; more are answered at once with a failure.
const MAX_QUEUED_RECOVERIES: usize = 4096;

/// Makes an [`IndexFeed`](crate::kv::IndexFeed)'s recoveries: at most
/// [`DEFAULT_CONCURRENT_RECOVERIES`] at once, one publisher at most once per
/// [`RECOVERY_INTERVAL`], none before its [`delay`](crate::kv::RecoveryNeed::delay)
/// (a request waits for its turn in the queue, not in a running slot), each on a connection of its own with the client's timeout and bounds. A
/// repair never blocks the feed: answers come back through [`next`](Self::next),
/// which a router awaits beside its subscriber.
///
/// ```no_run
/// use eventplane::kv::{IndexFeed, RecoveryClientConfig, RecoveryDriver};
/// # async fn run(mut feed: IndexFeed) {
/// let mut driver = RecoveryDriver::new(RecoveryClientConfig::default());
/// loop {
///     driver.submit(feed.take_recoveries());
///     let answer = driver.next().await;
///     feed.recovered(answer);
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct RecoveryDriver {
    config: RecoveryClientConfig,
    running: tokio::task::JoinSet<RecoveryAnswer>,
    /// Waiting, each with when its publisher may be asked again.
    queued: std::collections::VecDeque<(tokio::time::Instant, RecoveryNeed)>,
    last: crate::hash::FastMap<crate::discovery::ChannelId, tokio::time::Instant>,
    refused: Vec<RecoveryAnswer>,
    /// The bus recoveries go through, and whether to dial directly when no broker is
    /// up for a namespace it grants.
    #[cfg(feature = "tunnel")]
    bus: Option<(crate::tunnel::EventBus, bool)>,
}

impl RecoveryDriver {
    /// A driver asking with `config`.
    pub fn new(config: RecoveryClientConfig) -> RecoveryDriver {
        RecoveryDriver {
            config,
            running: tokio::task::JoinSet::new(),
            queued: std::collections::VecDeque::new(),
            last: crate::hash::FastMap::default(),
            refused: Vec::new(),
            #[cfg(feature = "tunnel")]
            bus: None,
        }
    }

    /// Reaching workers as the router's subscriber reaches their publishers (feature
    /// `tunnel`): a publisher a source announced with a recovery log is asked through
    /// that source's session; a recovery endpoint in a namespace a broker credential
    /// grants, through the broker that owns the publisher (it dials only what its
    /// discovery view advertises, recovery endpoints included); others directly. With
    /// `direct_fallback` (as
    /// [`DynamicSubscriberBuilder::tunnel_direct_fallback`](crate::subscriber::DynamicSubscriberBuilder::tunnel_direct_fallback)),
    /// a granted namespace no broker is up for is dialled directly.
    ///
    /// ```no_run
    /// # fn run(bus: eventplane::tunnel::EventBus) {
    /// use eventplane::kv::{RecoveryClientConfig, RecoveryDriver};
    /// let driver = RecoveryDriver::new(RecoveryClientConfig::default()).tunnel(bus, false);
    /// # drop(driver); }
    /// ```
    #[cfg(feature = "tunnel")]
    #[must_use]
    pub fn tunnel(mut self, bus: crate::tunnel::EventBus, direct_fallback: bool) -> RecoveryDriver {
        self.bus = Some((bus, direct_fallback));
        self
    }

    /// Recoveries started or waiting.
    pub fn pending(&self) -> usize {
        self.running.len() + self.queued.len() + self.refused.len()
    }

    /// Queues `needs` (each publisher's turn once per [`RECOVERY_INTERVAL`]).
    pub fn submit(&mut self, needs: Vec<RecoveryNeed>) {
        let now = tokio::time::Instant::now();
        for need in needs {
            if self.queued.len() >= MAX_QUEUED_RECOVERIES {
                let refused = Err(RecoveryError::Refused("too many recoveries queued".into()));
                self.refused
                    .push(RecoveryAnswer::new(&need, refused, Duration::ZERO));
                continue;
            }
            // Its turn: a second after its last, and not before its delay is over.
            let asked_at = now + need.delay;
            let turn = self
                .last
                .get(&need.publisher)
                .map_or(asked_at, |t| (*t + RECOVERY_INTERVAL).max(asked_at));
            self.last.insert(need.publisher.clone(), turn);
            self.queued.push_back((turn, need));
        }
        if self.last.len() > 4 * MAX_QUEUED_RECOVERIES {
            // Forget publishers not asked for a while.
            self.last.retain(|_, t| *t + RECOVERY_INTERVAL > now);
        }
        self.start(now);
    }

    /// Starts the queued requests whose turn has come, while slots are free.
    fn start(&mut self, now: tokio::time::Instant) {
        let mut i = 0;
        while self.running.len() < DEFAULT_CONCURRENT_RECOVERIES && i < self.queued.len() {
            if self.queued.get(i).is_some_and(|(turn, _)| *turn > now) {
                i += 1;
                continue;
            }
            let Some((_, need)) = self.queued.remove(i) else {
                return;
            };
            let config = self.config.clone();
            #[cfg(feature = "tunnel")]
            let bus = self.bus.clone();
            self.running.spawn(async move {
                let started = tokio::time::Instant::now();
                #[cfg(feature = "tunnel")]
                let answer = ask(&need, config, bus).await;
                #[cfg(not(feature = "tunnel"))]
                let answer = recover(&need.endpoint, need.request, config).await;
                RecoveryAnswer::new(&need, answer, started.elapsed())
            });
        }
    }

    /// The next answer; waits forever while nothing is pending (cancel-safe).
    pub async fn next(&mut self) -> RecoveryAnswer {
        if let Some(refused) = self.refused.pop() {
            return refused;
        }
        loop {
            let next_turn = self.queued.iter().map(|(turn, _)| *turn).min();
            tokio::select! {
                joined = self.running.join_next(), if !self.running.is_empty() => {
                    self.start(tokio::time::Instant::now());
                    match joined {
                        Some(Ok(answer)) => return answer,
                        Some(Err(e)) => tracing::warn!(error = %e, "a recovery task failed"),
                        None => {}
                    }
                }
                () = sleep_until(next_turn) => self.start(tokio::time::Instant::now()),
            }
        }
    }
}

/// Asks for `need` through `bus` when it reaches the worker that way, else directly;
/// within the config's timeout either way.
#[cfg(feature = "tunnel")]
async fn ask(
    need: &RecoveryNeed,
    config: RecoveryClientConfig,
    bus: Option<(crate::tunnel::EventBus, bool)>,
) -> Result<super::endpoint::Recovered, RecoveryError> {
    let Some((bus, direct_fallback)) = bus else {
        return recover(&need.endpoint, need.request, config).await;
    };
    let timeout = config.timeout;
    let announced = need
        .endpoint
        .starts_with(crate::discovery::ANNOUNCED_SCHEME);
    tokio::time::timeout(timeout, async {
        let reached = bus
            .reach(
                &need.publisher,
                &need.endpoint,
                announced,
                true,
                direct_fallback,
            )
            .await;
        let stream = match reached {
            None => return recover(&need.endpoint, need.request, config).await,
            Some(Ok(stream)) => stream,
            Some(Err(e)) => {
                return Err(RecoveryError::Connection(crate::zmtp::Error::Io(
                    std::io::Error::other(e),
                )));
            }
        };
        let socket = crate::zmtp::DealerSocket::handshake(stream, config.zmtp.clone()).await?;
        super::endpoint::recover_over(socket, need.request, config.max_bytes, config.max_blocks)
            .await
    })
    .await
    .map_err(|_| RecoveryError::Timeout(timeout))?
}

/// Sleeps until `at`, or forever.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::discovery::ChannelId;
    use crate::kv::RecoveryRequest;

    /// A need's delay holds it in the queue (no connection made) until it is over.
    #[tokio::test(start_paused = true)]
    async fn a_need_waits_its_delay() {
        let mut driver = RecoveryDriver::new(RecoveryClientConfig::default());
        let need = RecoveryNeed {
            publisher: ChannelId::new("ns", "c", "t", 1).unwrap(),
            endpoint: "tcp://127.0.0.1:1".to_owned(),
            request: RecoveryRequest::Dump,
            serial: 1,
            delay: Duration::from_secs(3),
        };
        let t0 = tokio::time::Instant::now();
        driver.submit(vec![need]);
        assert_eq!((driver.running.len(), driver.pending()), (0, 1));
        let early = tokio::time::timeout(Duration::from_millis(2_999), driver.next()).await;
        assert!(early.is_err(), "answered before its delay");
        assert_eq!((driver.running.len(), driver.pending()), (0, 1));
        let answer = driver.next().await;
        assert!(answer.answer.is_err(), "nothing listens there");
        assert!(t0.elapsed() >= Duration::from_secs(3));
    }
}
