//! Making an [`IndexFeed`](crate::kv::IndexFeed)'s recoveries: bounded, rate-limited,
//! beside the feed.

use std::time::Duration;

use super::endpoint::{Recovered, RecoveryClientConfig, RecoveryError, recover};

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

/// An answer from a [`RecoveryDriver`]: hand it to
/// [`IndexFeed::recovered`](crate::kv::IndexFeed::recovered).
pub type RecoveryAnswer = (
    crate::discovery::ChannelId,
    Result<Recovered, RecoveryError>,
    Duration,
);

/// Makes an [`IndexFeed`](crate::kv::IndexFeed)'s recoveries: at most
/// [`DEFAULT_CONCURRENT_RECOVERIES`] at once, one publisher at most once per
/// [`RECOVERY_INTERVAL`], each on a connection of its own with the client's timeout
/// and byte bound. A repair never blocks the feed: answers come back through
/// [`next`](Self::next), which a router awaits beside its subscriber.
///
/// ```no_run
/// use eventplane::kv::{IndexFeed, RecoveryClientConfig, RecoveryDriver};
/// # async fn run(mut feed: IndexFeed) {
/// let mut driver = RecoveryDriver::new(RecoveryClientConfig::default());
/// loop {
///     driver.submit(feed.take_recoveries());
///     let (publisher, answer, elapsed) = driver.next().await;
///     feed.recovered(&publisher, answer, elapsed);
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct RecoveryDriver {
    config: RecoveryClientConfig,
    running: tokio::task::JoinSet<RecoveryAnswer>,
    queued: std::collections::VecDeque<crate::kv::RecoveryNeed>,
    last: crate::hash::FastMap<crate::discovery::ChannelId, tokio::time::Instant>,
    refused: Vec<RecoveryAnswer>,
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
        }
    }

    /// Recoveries started or waiting.
    pub fn pending(&self) -> usize {
        self.running.len() + self.queued.len() + self.refused.len()
    }

    /// Starts (or queues) `needs`.
    pub fn submit(&mut self, needs: Vec<crate::kv::RecoveryNeed>) {
        for need in needs {
            if self.queued.len() >= MAX_QUEUED_RECOVERIES {
                self.refused.push((
                    need.publisher,
                    Err(RecoveryError::Refused("too many recoveries queued".into())),
                    Duration::ZERO,
                ));
                continue;
            }
            self.queued.push_back(need);
        }
        self.start();
    }

    fn start(&mut self) {
        while self.running.len() < DEFAULT_CONCURRENT_RECOVERIES {
            let Some(need) = self.queued.pop_front() else {
                return;
            };
            let now = tokio::time::Instant::now();
            let not_before = self
                .last
                .get(&need.publisher)
                .map_or(now, |t| *t + RECOVERY_INTERVAL);
            self.last
                .insert(need.publisher.clone(), not_before.max(now));
            if self.last.len() > 4 * MAX_QUEUED_RECOVERIES {
                // Forget publishers not asked for a while.
                self.last.retain(|_, t| *t + RECOVERY_INTERVAL > now);
            }
            let config = self.config.clone();
            self.running.spawn(async move {
                tokio::time::sleep_until(not_before).await;
                let started = tokio::time::Instant::now();
                let answer = recover(&need.endpoint, need.request, config).await;
                (need.publisher, answer, started.elapsed())
            });
        }
    }

    /// The next answer; waits forever while nothing is pending (cancel-safe).
    pub async fn next(&mut self) -> RecoveryAnswer {
        if let Some(refused) = self.refused.pop() {
            return refused;
        }
        loop {
            match self.running.join_next().await {
                Some(Ok(answer)) => {
                    self.start();
                    return answer;
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "a recovery task failed");
                    self.start();
                }
                None => std::future::pending::<()>().await,
            }
        }
    }
}
