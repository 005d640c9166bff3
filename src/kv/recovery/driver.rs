//! Making an [`IndexFeed`](crate::kv::router::IndexFeed)'s recoveries: bounded, rate-limited,
//! beside the feed.

use std::time::Duration;

use super::endpoint::{RecoveryClientConfig, RecoveryError, recover};
use crate::kv::router::{RecoveryAnswer, RecoveryNeed};

/// Recoveries made at once by a [`RecoveryDriver`] by default: 16.
pub(crate) const DEFAULT_CONCURRENT_RECOVERIES: usize = 16;

/// Shortest time between two recoveries of one publisher made by a
/// [`RecoveryDriver`]: 1 s (a publisher that keeps losing events is asked at most
/// once a second; its later losses wait).
pub(crate) const RECOVERY_INTERVAL: Duration = Duration::from_secs(1);

/// Most recoveries a [`RecoveryDriver`] queues (beyond [`DEFAULT_CONCURRENT_RECOVERIES`]
/// running; one per publisher): 4,096; more are answered with
/// [`RecoveryError::Busy`] once their delay is over.
const MAX_QUEUED_RECOVERIES: usize = 4096;

/// Running slots rebuilds may take ([`RecoveryNeed::rebuild`]): half, so that workers
/// whose endpoints keep failing cannot hold back the repairs of the others.
const MAX_RUNNING_REBUILDS: usize = DEFAULT_CONCURRENT_RECOVERIES / 2;

/// Makes an [`IndexFeed`](crate::kv::router::IndexFeed)'s recoveries: at most
/// 16 at once (rebuilds in half of them at most), one
/// publisher at most once a second, none before its
/// [`delay`](crate::kv::router::RecoveryNeed::delay) (a request waits for its turn in the
/// queue, not in a running slot; a newer request for a publisher replaces its queued
/// one, and one already being asked is not asked twice), each on a connection of its own with the client's timeout and bounds. A
/// repair never blocks the feed: answers come back through [`next`](Self::next),
/// which a router awaits beside its subscriber.
///
/// ```no_run
/// use eventplane::kv::{router::{IndexFeed, RecoveryClientConfig, RecoveryDriver}};
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
    /// The requests running: each publisher's serial, and whether it is a rebuild.
    in_flight: crate::hash::FastMap<crate::discovery::ChannelId, (u64, bool)>,
    /// Waiting, each with when its publisher may be asked (one per publisher).
    queued: std::collections::VecDeque<(tokio::time::Instant, RecoveryNeed)>,
    /// When each publisher was last asked.
    started: crate::hash::FastMap<crate::discovery::ChannelId, tokio::time::Instant>,
    /// Refused (the queue was full), each answered once its delay is over.
    refused: std::collections::VecDeque<(tokio::time::Instant, RecoveryAnswer)>,
    /// The bus recoveries go through, and whether to dial directly when no broker is
    /// up for a namespace it grants.
    #[cfg(feature = "tunnel")]
    bus: Option<(crate::tunnel::EventBus, bool)>,
    /// Where Dynamo workers' answers come back (their `dynamo+…` targets).
    #[cfg(feature = "dynamo-recovery")]
    dynamo: Option<std::sync::Arc<crate::kv::dynamo_recovery::CallHomeListener>>,
}

impl RecoveryDriver {
    /// A driver asking with `config`.
    pub fn new(config: RecoveryClientConfig) -> RecoveryDriver {
        RecoveryDriver {
            config,
            running: tokio::task::JoinSet::new(),
            in_flight: crate::hash::FastMap::default(),
            queued: std::collections::VecDeque::new(),
            started: crate::hash::FastMap::default(),
            refused: std::collections::VecDeque::new(),
            #[cfg(feature = "tunnel")]
            bus: None,
            #[cfg(feature = "dynamo-recovery")]
            dynamo: None,
        }
    }

    /// Asks Dynamo workers too (feature `dynamo-recovery`, which `etcd` and `kube` enable): a publisher whose recovery
    /// endpoint is a Dynamo `recovery_target` (`dynamo+CODEC://…`, see
    /// [`Instance::recovery`](crate::discovery::Instance::recovery)) is asked over
    /// Dynamo's request plane, its answer taken on `listener`. Without it such a
    /// publisher's recoveries are refused (`RecoveryError::Refused`: wiped on a loss,
    /// as a worker with no recovery endpoint).
    ///
    /// ```no_run
    /// # async fn run() -> std::io::Result<()> {
    /// use std::sync::Arc;
    /// use eventplane::kv::dynamo_recovery::{CallHomeConfig, CallHomeListener};
    /// use eventplane::kv::{router::{RecoveryClientConfig, RecoveryDriver}};
    /// let home = CallHomeListener::bind("0.0.0.0:0".parse().unwrap(), CallHomeConfig::default()).await?;
    /// let driver = RecoveryDriver::new(RecoveryClientConfig::default()).dynamo(Arc::new(home));
    /// # drop(driver); Ok(()) }
    /// ```
    #[cfg(feature = "dynamo-recovery")]
    #[must_use]
    pub fn dynamo(
        mut self,
        listener: std::sync::Arc<crate::kv::dynamo_recovery::CallHomeListener>,
    ) -> RecoveryDriver {
        self.dynamo = Some(listener);
        self
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
    /// use eventplane::kv::{router::{RecoveryClientConfig, RecoveryDriver}};
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

    /// Queues `needs` (each publisher's turn once a second, after its
    /// delay). A need for a publisher with one queued replaces it; one whose request
    /// is running already (the same serial) is dropped.
    pub fn submit(&mut self, needs: Vec<RecoveryNeed>) {
        let now = tokio::time::Instant::now();
        for need in needs {
            if self
                .in_flight
                .get(&need.publisher)
                .is_some_and(|(serial, _)| *serial == need.serial)
            {
                continue;
            }
            // Its turn: a second after it was last asked, and its delay over.
            let asked_at = now + need.delay;
            let turn = self
                .started
                .get(&need.publisher)
                .map_or(asked_at, |t| (*t + RECOVERY_INTERVAL).max(asked_at));
            if let Some(queued) = self
                .queued
                .iter_mut()
                .find(|(_, q)| q.publisher == need.publisher)
            {
                *queued = (turn, need);
                continue;
            }
            if self.queued.len() >= MAX_QUEUED_RECOVERIES {
                // Answered once its delay is over (a refusal at once would come back
                // at once as a rebuild): one per publisher, the newest.
                self.refused.retain(|(_, a)| a.publisher != need.publisher);
                let answer = RecoveryAnswer::new(&need, Err(RecoveryError::Busy), Duration::ZERO);
                self.refused.push_back((asked_at, answer));
                continue;
            }
            self.queued.push_back((turn, need));
        }
        if self.started.len() > 4 * MAX_QUEUED_RECOVERIES {
            // Forget publishers not asked for a while.
            self.started.retain(|_, t| *t + RECOVERY_INTERVAL > now);
        }
        self.start(now);
    }

    /// Starts the queued requests whose turn has come, while slots are free.
    fn start(&mut self, now: tokio::time::Instant) {
        let mut i = 0;
        while self.running.len() < DEFAULT_CONCURRENT_RECOVERIES && i < self.queued.len() {
            let rebuilds = self.in_flight.values().filter(|(_, r)| *r).count();
            if self.queued.get(i).is_some_and(|(turn, need)| {
                *turn > now || (need.rebuild && rebuilds >= MAX_RUNNING_REBUILDS)
            }) {
                i += 1;
                continue;
            }
            let Some((_, need)) = self.queued.remove(i) else {
                return;
            };
            self.started.insert(need.publisher.clone(), now);
            self.in_flight
                .insert(need.publisher.clone(), (need.serial, need.rebuild));
            let config = self.config.clone();
            #[cfg(feature = "tunnel")]
            let bus = self.bus.clone();
            #[cfg(feature = "dynamo-recovery")]
            let dynamo = self.dynamo.clone();
            self.running.spawn(async move {
                let started = tokio::time::Instant::now();
                if need.endpoint.starts_with("dynamo+") {
                    #[cfg(feature = "dynamo-recovery")]
                    let answer = match &dynamo {
                        Some(home) => {
                            crate::kv::dynamo_recovery::recover_dynamo(
                                home,
                                &need.endpoint,
                                need.request,
                                &config,
                            )
                            .await
                        }
                        None => Err(no_dynamo()),
                    };
                    #[cfg(not(feature = "dynamo-recovery"))]
                    let answer = Err(no_dynamo());
                    return RecoveryAnswer::new(&need, answer, started.elapsed());
                }
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
        loop {
            let now = tokio::time::Instant::now();
            let due = self.refused.iter().position(|(at, _)| *at <= now);
            if let Some((_, refused)) = due.and_then(|i| self.refused.remove(i)) {
                return refused;
            }
            // The next time a queued request may start: none while every slot is
            // taken, and none for rebuilds while theirs are (an answer frees one;
            // waking before would spin).
            let slots_full = self.running.len() >= DEFAULT_CONCURRENT_RECOVERIES;
            let rebuilds_full =
                self.in_flight.values().filter(|(_, r)| *r).count() >= MAX_RUNNING_REBUILDS;
            let next_turn = self
                .queued
                .iter()
                .filter(|(_, need)| !(slots_full || (need.rebuild && rebuilds_full)))
                .map(|(turn, _)| *turn)
                .chain(self.refused.iter().map(|(at, _)| *at))
                .min();
            tokio::select! {
                joined = self.running.join_next(), if !self.running.is_empty() => {
                    match joined {
                        Some(Ok(answer)) => {
                            if self
                                .in_flight
                                .get(&answer.publisher)
                                .is_some_and(|(serial, _)| *serial == answer.serial)
                            {
                                self.in_flight.remove(&answer.publisher);
                            }
                            self.start(tokio::time::Instant::now());
                            return answer;
                        }
                        Some(Err(e)) => tracing::warn!(error = %e, "a recovery task failed"),
                        None => {}
                    }
                    self.start(tokio::time::Instant::now());
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

/// A Dynamo recovery target with no call-home listener to take its answers.
fn no_dynamo() -> RecoveryError {
    RecoveryError::Refused(
        "a Dynamo recovery target, and no call-home listener (RecoveryDriver::dynamo)".to_owned(),
    )
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
    use crate::kv::router::RecoveryRequest;

    /// Publisher `p`'s need `serial`, asked after `delay` (nothing listens there).
    fn need(p: u64, serial: u64, delay: u64) -> RecoveryNeed {
        RecoveryNeed {
            publisher: ChannelId::new("ns", "c", "t", p).unwrap(),
            endpoint: "tcp://127.0.0.1:1".to_owned(),
            request: RecoveryRequest::Dump,
            serial,
            delay: Duration::from_secs(delay),
            rebuild: delay > 0,
        }
    }

    /// A need's delay holds it in the queue (no connection made) until it is over.
    #[tokio::test(start_paused = true)]
    async fn a_need_waits_its_delay() {
        let mut driver = RecoveryDriver::new(RecoveryClientConfig::default());
        let need = need(1, 1, 3);
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

    /// A publisher has one need queued: a newer one replaces it (and its turn), and
    /// one already being asked is not asked twice.
    #[tokio::test(start_paused = true)]
    async fn one_need_per_publisher_the_newest() {
        let mut driver = RecoveryDriver::new(RecoveryClientConfig::default());
        let t0 = tokio::time::Instant::now();
        driver.submit(vec![need(1, 7, 60)]);
        assert_eq!((driver.running.len(), driver.pending()), (0, 1));
        // The same request, hurried: it replaces the waiting one and starts now.
        driver.submit(vec![need(1, 7, 0)]);
        assert_eq!((driver.running.len(), driver.pending()), (1, 1));
        // Handed out again while it runs: not asked twice.
        driver.submit(vec![need(1, 7, 0)]);
        assert_eq!(driver.pending(), 1);
        let answer = driver.next().await;
        assert_eq!(answer.serial, 7);
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "asked without its delay"
        );
        assert_eq!(driver.pending(), 0);
        // A publisher asked a moment ago waits its interval, whatever its delay.
        driver.submit(vec![need(1, 8, 0)]);
        assert_eq!((driver.running.len(), driver.pending()), (0, 1));
    }

    /// Past the queue's bound, a need is refused ([`RecoveryError::Busy`]) once its
    /// delay is over, not at once (a refusal at once would come back at once).
    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_after_the_delay() {
        let mut driver = RecoveryDriver::new(RecoveryClientConfig::default());
        let waiting: Vec<_> = (0..MAX_QUEUED_RECOVERIES as u64)
            .map(|p| need(p + 10, 1, 600))
            .collect();
        driver.submit(waiting);
        let t0 = tokio::time::Instant::now();
        driver.submit(vec![need(1, 9, 2)]);
        let answer = driver.next().await;
        assert_eq!(answer.serial, 9);
        assert!(matches!(answer.answer, Err(RecoveryError::Busy)));
        let at = t0.elapsed();
        assert!(
            at >= Duration::from_secs(2) && at < Duration::from_secs(3),
            "{at:?}"
        );
    }
}
