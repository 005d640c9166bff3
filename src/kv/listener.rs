//! `EngineListener`: subscribes to an engine's KV event PUB and feeds the processor.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::EngineReplayStats;
use super::replay::ReplayLimits;
use super::stale::{Forwarded, ViewLoss};
use super::{EngineDecoder, EngineStats, PlacementEvent, WorkerId};
use crate::config::{self, ConfigError};
use crate::counter;
use crate::net::{Backoff, RateLimitedWarn, random_unit};
use crate::wire::{Framed, Layout, SeqStep, SeqTracker};
use crate::zmtp::{self, SubSocket};

mod replaying;

/// How often an [`EngineListener`] pings its engine by default, and how long it waits
/// for the answer: 10 s.
///
/// ```
/// assert_eq!(eventplane::kv::engine::ENGINE_HEARTBEAT, std::time::Duration::from_secs(10));
/// ```
pub const ENGINE_HEARTBEAT: Duration = Duration::from_secs(10);

/// Settings of an [`EngineListener`].
///
/// ```
/// use std::time::Duration;
/// use eventplane::kv::{WorkerId, engine::EngineListenerConfig};
/// let config = EngineListenerConfig::new("tcp://127.0.0.1:5557", "kv-events", WorkerId(1), 16)
///     .reconnect_backoff(Duration::from_millis(50), Duration::from_secs(2));
/// # let _ = config;
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct EngineListenerConfig {
    endpoint: String,
    topic: Bytes,
    worker_id: WorkerId,
    block_size: usize,
    zmtp: zmtp::Config,
    reconnect_min: Duration,
    reconnect_max: Duration,
    max_batch_elements: usize,
    max_batch_events: usize,
    replay_endpoint: Option<String>,
    replay_limits: ReplayLimits,
}

impl EngineListenerConfig {
    /// The worker the router events are stamped with.
    pub fn worker_id(&self) -> WorkerId {
        self.worker_id
    }

    /// Listen to `endpoint` (`tcp://host:port`) for `topic`, as `worker_id`, whose
    /// engine uses `block_size` tokens per block. Reconnects with jittered backoff
    /// 100 ms → 5 s. The ZMTP config pings the engine every
    /// [`ENGINE_HEARTBEAT`] and ends the connection when no answer comes within as
    /// long: an engine that hangs or whose host vanished without closing the
    /// connection is a lost connection (and its view cleared) within twice that,
    /// not never. (libzmq answers pings from its I/O thread; a ZMTP 3.0 engine is not
    /// pinged.)
    pub fn new(
        endpoint: impl Into<String>,
        topic: impl Into<Bytes>,
        worker_id: WorkerId,
        block_size: usize,
    ) -> EngineListenerConfig {
        EngineListenerConfig {
            endpoint: endpoint.into(),
            topic: topic.into(),
            worker_id,
            block_size,
            zmtp: zmtp::Config::builder()
                .heartbeat_interval(Some(ENGINE_HEARTBEAT))
                .build()
                .unwrap_or_default(),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
            max_batch_elements: super::DEFAULT_MAX_BATCH_ELEMENTS,
            max_batch_events: super::DEFAULT_MAX_BATCH_EVENTS,
            replay_endpoint: None,
            replay_limits: ReplayLimits::default(),
        }
    }

    /// The engine's replay endpoint (`tcp://host:port`, its ROUTER: vLLM's and
    /// SGLang's `replay_endpoint`). With it, a loss is repaired instead of cleared: on a
    /// batch-sequence gap, and on every connection to the engine (the first one
    /// included), the listener asks the engine for what it missed and applies it in
    /// order, holding live batches meanwhile. It clears only when the engine's buffer
    /// cannot cover the loss: see [`ReplayFallback`](super::ReplayFallback) for the causes. Default: none
    /// (every loss clears). A connection that ends is cleared only when the engine is
    /// not back within the replay timeout.
    ///
    /// ```
    /// use eventplane::kv::{WorkerId, engine::EngineListenerConfig};
    /// let config = EngineListenerConfig::new("tcp://127.0.0.1:5557", "", WorkerId(1), 16)
    ///     .engine_replay("tcp://127.0.0.1:5558");
    /// assert!(config.validate().is_ok());
    /// ```
    pub fn engine_replay(mut self, endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(endpoint.into());
        self
    }

    /// Bounds of a replay: how long to wait for each reply (default
    /// 2 s), how long one replay
    /// may take in all (30 s),
    /// and the batches applied from one replay
    /// (10,000). None may be
    /// zero, and the deadline may not be shorter than the timeout.
    pub fn replay_limits(
        mut self,
        timeout: Duration,
        deadline: Duration,
        max_batches: u64,
    ) -> Self {
        self.replay_limits = ReplayLimits {
            timeout,
            deadline,
            max_batches,
        };
        self
    }

    /// For an engine with data-parallel rank `rank`: offsets the port of the engine
    /// endpoint and of the replay endpoint by `rank`, as vLLM and SGLang offset theirs
    /// (rank 0 keeps them). An endpoint without a port is refused by
    /// [`validate`](Self::validate).
    ///
    /// ```
    /// use eventplane::kv::{WorkerId, engine::EngineListenerConfig};
    /// let config = EngineListenerConfig::new("tcp://10.0.0.5:5557", "", WorkerId(1), 16)
    ///     .engine_replay("tcp://10.0.0.5:6557")
    ///     .engine_dp_rank(2);
    /// assert_eq!(config.endpoint(), "tcp://10.0.0.5:5559");
    /// assert_eq!(config.replay_endpoint(), Some("tcp://10.0.0.5:6559"));
    /// ```
    pub fn engine_dp_rank(mut self, rank: u32) -> Self {
        self.endpoint = offset_port(&self.endpoint, rank);
        self.replay_endpoint = self.replay_endpoint.map(|e| offset_port(&e, rank));
        self
    }

    /// The engine's PUB endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The engine's replay endpoint, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Per-batch decoding budgets (see [`EngineDecoder::with_limits`]). Defaults 2^19
    /// msgpack elements and 2^16 events.
    pub fn batch_limits(mut self, max_elements: usize, max_events: usize) -> Self {
        self.max_batch_elements = max_elements;
        self.max_batch_events = max_events;
        self
    }

    /// The first refused value, if any, named as its setter (`endpoint` and
    /// `block_size` for the constructor's). [`EngineListener::new`] calls it; call it yourself
    /// to check settings before starting anything else.
    ///
    /// ```
    /// use eventplane::kv::{WorkerId, engine::EngineListenerConfig};
    /// let config = EngineListenerConfig::new("tcp://127.0.0.1:5557", "kv", WorkerId(1), 0);
    /// assert_eq!(config.validate().unwrap_err().field(), "block_size");
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.decoder().map(drop)
    }

    fn decoder(&self) -> Result<EngineDecoder, ConfigError> {
        if let Err(e) = zmtp::parse_tcp(&self.endpoint) {
            return Err(ConfigError::Invalid {
                field: "endpoint",
                reason: e.to_string(),
            });
        }
        config::backoff_range("reconnect_backoff", self.reconnect_min, self.reconnect_max)?;
        if let Some(e) = &self.replay_endpoint {
            if let Err(e) = zmtp::parse_tcp(e) {
                return Err(ConfigError::Invalid {
                    field: "engine_replay",
                    reason: e.to_string(),
                });
            }
        }
        let l = self.replay_limits;
        if l.max_batches == 0 || l.timeout.is_zero() || l.deadline < l.timeout {
            return Err(ConfigError::Invalid {
                field: "replay_limits",
                reason: "the timeout must be positive and the deadline at least as long".into(),
            });
        }
        EngineDecoder::new(self.worker_id, self.block_size)?
            .with_limits(self.max_batch_elements, self.max_batch_events)
            .map_err(|e| e.renamed("batch_limits"))
    }

    /// ZMTP bounds and timeouts. Default `zmtp::Config::default()` with heartbeats
    /// every [`ENGINE_HEARTBEAT`] (timeout as long); a config without heartbeats
    /// cannot tell a hung engine from an idle one.
    pub fn zmtp_config(mut self, config: zmtp::Config) -> Self {
        self.zmtp = config;
        self
    }

    /// Reconnect backoff bounds. Default 100 ms → 5 s.
    pub fn reconnect_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.reconnect_min = min;
        self.reconnect_max = max;
        self
    }
}

/// Counters of an [`EngineListener`].
///
/// ```
/// use eventplane::kv::{WorkerId, engine::{EngineListener, EngineListenerConfig}};
/// let (tx, _rx) = tokio::sync::mpsc::channel(8);
/// let listener = EngineListener::new(
///     EngineListenerConfig::new("tcp://127.0.0.1:5557", "kv", WorkerId(1), 16),
///     tx,
/// )?;
/// let stats = listener.handle().stats();
/// assert_eq!((stats.seq_gaps, stats.discarded_events, stats.decoder.batches), (0, 0, 0));
/// # Ok::<(), eventplane::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct EngineListenerStats {
    /// Messages that were not `[topic, seq u64be, payload]` with the exact topic.
    pub malformed_messages: u64,
    /// Forward jumps in the engine's batch sequence (its PUB dropped batches).
    pub seq_gaps: u64,
    /// Batches missing in those jumps.
    pub seq_gap_batches: u64,
    /// Sequence restarts: a regression, a restart at 0 on a new connection, or a jump
    /// of more than 2^32.
    pub seq_resets: u64,
    /// Connections that ended and were dialled again.
    pub reconnects: u64,
    /// Dials or handshakes that failed.
    pub connect_failures: u64,
    /// Decoded events discarded because the listener was cancelled while the
    /// processor's input was full (stop the listener first and let the processor
    /// drain to make this 0).
    pub discarded_events: u64,
    /// `Cleared` events the listener made itself because it lost track of the engine
    /// (a connection that ended, a sequence gap or reset): one per data-parallel rank
    /// it had forwarded events for since the last clear, so that routers drop what
    /// they hold of this engine (DESIGN §4.6).
    pub stale_clears: u64,
    /// Events forwarded for a rank beyond the first
    /// 64 since the last clear: a
    /// lost view cannot be cleared for those ranks.
    pub untracked_ranks: u64,
    /// Whether a connection to the engine is up now (handshake done).
    pub connected: bool,
    /// Decoder counters.
    pub decoder: EngineStats,
    /// Repairs from the engine's replay buffer (all 0 without
    /// [`EngineListenerConfig::engine_replay`]).
    pub replay: EngineReplayStats,
}

#[derive(Debug, Default)]
struct Counters {
    malformed: AtomicU64,
    seq_gaps: AtomicU64,
    seq_gap_batches: AtomicU64,
    seq_resets: AtomicU64,
    reconnects: AtomicU64,
    connect_failures: AtomicU64,
    discarded_events: AtomicU64,
    stale_clears: AtomicU64,
    untracked_ranks: AtomicU64,
    connected: std::sync::atomic::AtomicBool,
    decoder: std::sync::Mutex<EngineStats>,
    replay: std::sync::Mutex<EngineReplayStats>,
}

/// Reads a running listener's counters.
///
/// ```
/// use eventplane::kv::{WorkerId, engine::{EngineListener, EngineListenerConfig}};
/// let (tx, _rx) = tokio::sync::mpsc::channel(8);
/// let listener = EngineListener::new(
///     EngineListenerConfig::new("tcp://127.0.0.1:5557", "kv", WorkerId(1), 16),
///     tx,
/// )?;
/// let handle = listener.handle(); // cloneable; read it while `run` owns the listener
/// assert_eq!(handle.stats().reconnects, 0);
/// # Ok::<(), eventplane::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct EngineListenerHandle {
    counters: Arc<Counters>,
    cancel: CancellationToken,
}

impl EngineListenerHandle {
    /// A snapshot.
    pub fn stats(&self) -> EngineListenerStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EngineListenerStats {
            malformed_messages: l(&c.malformed),
            seq_gaps: l(&c.seq_gaps),
            seq_gap_batches: l(&c.seq_gap_batches),
            seq_resets: l(&c.seq_resets),
            reconnects: l(&c.reconnects),
            connect_failures: l(&c.connect_failures),
            discarded_events: l(&c.discarded_events),
            stale_clears: l(&c.stale_clears),
            untracked_ranks: l(&c.untracked_ranks),
            connected: c.connected.load(Ordering::Relaxed),
            decoder: *c.decoder.lock().unwrap_or_else(|p| p.into_inner()),
            replay: *c.replay.lock().unwrap_or_else(|p| p.into_inner()),
        }
    }

    /// Asks the listener to stop (as cancelling the token given to
    /// [`EngineListener::cancellation`] does).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }
}

/// Subscribes to an engine's KV event PUB (`[topic, seq u64be, msgpack batch]`),
/// decodes each batch and sends it as one list to the processor's bounded input.
///
/// A full processor input makes the listener wait (it never drops a decoded batch
/// while running); the engine's PUB then drops at its high-water mark, which shows
/// here as `seq_gaps`. Cancelled while waiting, it discards that one batch and counts
/// it in `discarded_events`: to stop without loss, cancel the listener, await it, and
/// let the processor drain on input close. The connection is re-established with
/// backoff until cancelled; a batch sequence restarting at 0 on a new connection is a
/// reset, not a gap.
///
/// **Loss before the worker reaches the routers.** When the listener loses track of
/// what the engine holds — the connection ends, the batch sequence skips (the engine's
/// PUB dropped batches) or starts again (a new engine), a batch is rejected whole or a
/// removal in it cannot be decoded — it sends, ahead of any later event, a `Cleared`
/// for every data-parallel rank it forwarded events for since the last clear. (Events
/// of unknown types are skipped without a clear: a future engine's new event kinds
/// must not wipe every router.) A router that applies `Cleared` (ours, the [guide](crate::guide)'s,
/// Dynamo's) then drops those ranks' blocks instead of keeping blocks the engine may
/// no longer hold; after an engine restart it holds only what the new engine stored.
/// Counted in [`EngineListenerStats::stale_clears`], warned about (rate-limited).
/// Event ids stay dense: a router sees a clear, not a hole (DESIGN §4.6).
///
/// **Repair instead, with the engine's replay endpoint**
/// ([`EngineListenerConfig::engine_replay`]). On a sequence gap, on every connection
/// (the first included: a listener that starts late rebuilds what the engine's buffer
/// holds), and when the engine has been quiet for a moment after publishing (its PUB
/// drops the end of a burst as readily as the middle), the listener asks the engine
/// for what it missed and applies it in order, holding live batches meanwhile. It asks
/// from the last batch it applied, so the first reply proves the same engine (the same
/// batch) or shows a new one (another batch under that number: clear, then replay the
/// new engine from 0). It clears only when the buffer cannot cover the loss, counted
/// by cause in [`EngineListenerStats::replay`]; a lost connection is cleared only when
/// the engine is not back within the replay timeout.
///
/// ```no_run
/// use eventplane::kv::{WorkerId, engine::{EngineListener, EngineListenerConfig}};
/// use tokio_util::sync::CancellationToken;
/// # async fn run() -> Result<(), eventplane::ConfigError> {
/// let (tx, rx) = tokio::sync::mpsc::channel(256);
/// let listener = EngineListener::new(
///     EngineListenerConfig::new("tcp://127.0.0.1:5557", "kv-events", WorkerId(1), 16),
///     tx,
/// )?;
/// let stop = CancellationToken::new();
/// tokio::spawn(listener.cancellation(&stop).run());
/// // ... later: stop.cancel(), then let the processor drain on input close.
/// # drop(rx); Ok(()) }
/// ```
#[derive(Debug)]
pub struct EngineListener {
    config: EngineListenerConfig,
    decoder: EngineDecoder,
    output: mpsc::Sender<Vec<PlacementEvent>>,
    counters: Arc<Counters>,
    cancel: CancellationToken,
}

impl EngineListener {
    /// A listener sending to `output`, or the [`ConfigError`] naming the first refused
    /// value (a zero block size or batch limit, a zero or inverted backoff).
    pub fn new(
        config: EngineListenerConfig,
        output: mpsc::Sender<Vec<PlacementEvent>>,
    ) -> Result<Self, ConfigError> {
        let decoder = config.decoder()?;
        Ok(EngineListener {
            config,
            decoder,
            output,
            counters: Arc::default(),
            cancel: CancellationToken::new(),
        })
    }

    /// Stop when `token` is cancelled (the listener uses a child of it). Default: a
    /// token of its own, cancelled through [`EngineListenerHandle::cancel`]. Every
    /// long-running part of the crate takes its token this way.
    #[must_use]
    pub fn cancellation(mut self, token: &CancellationToken) -> Self {
        self.cancel = token.child_token();
        self
    }

    /// A handle for stats and cancellation.
    pub fn handle(&self) -> EngineListenerHandle {
        EngineListenerHandle {
            counters: self.counters.clone(),
            cancel: self.cancel.clone(),
        }
    }

    /// Runs until cancelled or until the processor's input closes.
    pub async fn run(self) -> EngineListenerStats {
        if let Some(endpoint) = self.config.replay_endpoint.clone() {
            return self.run_replaying(endpoint).await;
        }
        let cancel = self.cancel.clone();
        let mut decoder = self.decoder.clone();
        let mut backoff = Backoff::checked(self.config.reconnect_min, self.config.reconnect_max);
        let warn = RateLimitedWarn::default();
        let mut seq_tracker = SeqTracker::default();
        let mut forwarded = Forwarded::default();
        let mut connected_before = false;
        loop {
            let connected = tokio::select! {
                () = cancel.cancelled() => break,
                r = self.connect() => r,
            };
            let mut sub = match connected {
                Ok(s) => s,
                Err(e) => {
                    counter::add(&self.counters.connect_failures, 1);
                    if warn.check("connect", Instant::now()).is_some() {
                        tracing::warn!(endpoint = %self.config.endpoint, error = %crate::net::ErrorChain(&e), "engine connection failed; retrying with backoff");
                    }
                    let delay = backoff.next_delay(random_unit());
                    tokio::select! {
                        () = cancel.cancelled() => break,
                        () = tokio::time::sleep(delay) => continue,
                    }
                }
            };
            self.connected(&mut connected_before, &mut backoff, &mut seq_tracker);
            loop {
                let msg = tokio::select! {
                    () = cancel.cancelled() => return self.finish(&decoder),
                    m = sub.recv() => m,
                };
                let msg = match msg {
                    Ok(m) => m,
                    Err(e) => {
                        if warn.check("recv", Instant::now()).is_some() {
                            tracing::warn!(endpoint = %self.config.endpoint, error = %crate::net::ErrorChain(&e), "engine connection lost; reconnecting");
                        }
                        break;
                    }
                };
                // Engines send exactly [topic, seq, payload].
                let framed = Layout::TopicSeq.parse(Some(&self.config.topic), &msg);
                let (
                    Ok(Framed {
                        sequence: Some(seq),
                        payload: Some(payload),
                        ..
                    }),
                    3,
                ) = (framed, msg.len())
                else {
                    counter::add(&self.counters.malformed, 1);
                    continue;
                };
                let mut loss = self.observe_seq(&mut seq_tracker, seq);
                let before = decoder.stats();
                let decoded = decoder.decode_batch(&payload);
                let after = decoder.stats();
                *self
                    .counters
                    .decoder
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = after;
                if loss.is_none()
                    && (after.malformed_batches > before.malformed_batches
                        || after.failed_removals > before.failed_removals)
                {
                    loss = Some(ViewLoss::Undecodable);
                }
                let batch = decoded.unwrap_or_default();
                // The clears come first: what this batch says is what the engine
                // holds after the loss.
                let events = match loss {
                    Some(loss) => {
                        let mut events = self.clears(loss, &mut forwarded, &mut decoder, &warn);
                        events.extend(batch);
                        // Raw ids in list order (the clears took theirs after the
                        // batch's), so the processor sees no jump.
                        let first = events.iter().map(|e| e.event.id).min().unwrap_or(0);
                        for (id, ev) in (first..).zip(events.iter_mut()) {
                            ev.event.id = id;
                        }
                        events
                    }
                    None => batch,
                };
                if !self.forward(events, &mut forwarded).await {
                    return self.finish(&decoder);
                }
            }
            self.counters.connected.store(false, Ordering::Relaxed);
            // What the engine sends until the next connection is lost, and a new
            // engine holds nothing of what this one stored.
            let clears = self.clears(ViewLoss::Disconnected, &mut forwarded, &mut decoder, &warn);
            if !self.forward(clears, &mut forwarded).await {
                return self.finish(&decoder);
            }
            let delay = backoff.next_delay(random_unit());
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep(delay) => {}
            }
        }
        self.finish(&decoder)
    }

    /// Sends `events` (if any) to the processor as one list, noting what routers will
    /// hold. `false` when the listener must stop: cancelled while the processor's
    /// input was full (the list is then counted as discarded), or the processor gone.
    async fn forward(&self, events: Vec<PlacementEvent>, forwarded: &mut Forwarded) -> bool {
        if events.is_empty() {
            return true;
        }
        let permit = tokio::select! {
            () = self.cancel.cancelled() => {
                // Last chance without waiting; otherwise counted, not lost.
                let n = events.len() as u64;
                let untracked = forwarded.note(&events);
                match self.output.try_send(events) {
                    Ok(()) => counter::add(&self.counters.untracked_ranks, untracked),
                    Err(_) => counter::add(&self.counters.discarded_events, n),
                }
                return false;
            }
            r = self.output.reserve() => r,
        };
        match permit {
            Ok(permit) => {
                counter::add(&self.counters.untracked_ranks, forwarded.note(&events));
                permit.send(events);
                true
            }
            // The processor is gone: nothing will ever take these.
            Err(_) => {
                counter::add(&self.counters.discarded_events, events.len() as u64);
                false
            }
        }
    }

    /// The `Cleared` events that make routers drop what they hold of this engine,
    /// after `loss` (none when nothing was forwarded since the last clear).
    fn clears(
        &self,
        loss: ViewLoss,
        forwarded: &mut Forwarded,
        decoder: &mut EngineDecoder,
        warn: &RateLimitedWarn,
    ) -> Vec<PlacementEvent> {
        let ranks = forwarded.take();
        if ranks.is_empty() {
            return Vec::new();
        }
        counter::add(&self.counters.stale_clears, ranks.len() as u64);
        if let Some(suppressed) = warn.check(loss.as_str(), Instant::now()) {
            let missing = match loss {
                ViewLoss::Gap(n) => n,
                _ => 0,
            };
            tracing::warn!(
                endpoint = %self.config.endpoint,
                cause = loss.as_str(),
                missing_batches = missing,
                ranks = ?ranks,
                suppressed,
                "lost track of the engine's KV state; sending Cleared so routers drop this worker's blocks"
            );
        }
        ranks.into_iter().map(|r| decoder.cleared(r)).collect()
    }

    async fn connect(&self) -> Result<SubSocket, zmtp::Error> {
        let mut sub = SubSocket::connect(&self.config.endpoint, self.config.zmtp.clone()).await?;
        sub.subscribe(self.config.topic.clone()).await?;
        Ok(sub)
    }

    /// A connection to the engine is up: counted, and the sequence starts a new
    /// connection.
    fn connected(&self, before: &mut bool, backoff: &mut Backoff, seq: &mut SeqTracker) {
        if std::mem::replace(before, true) {
            counter::add(&self.counters.reconnects, 1);
        }
        self.counters.connected.store(true, Ordering::Relaxed);
        backoff.reset();
        seq.new_connection();
    }

    fn observe_seq(&self, tracker: &mut SeqTracker, seq: u64) -> Option<ViewLoss> {
        let c = &self.counters;
        match tracker.observe(seq) {
            SeqStep::InOrder => None,
            SeqStep::Gap(missing) => {
                counter::add(&c.seq_gaps, 1);
                counter::add(&c.seq_gap_batches, missing);
                Some(ViewLoss::Gap(missing))
            }
            SeqStep::Reset => {
                counter::add(&c.seq_resets, 1);
                Some(ViewLoss::Reset)
            }
        }
    }

    fn finish(&self, decoder: &EngineDecoder) -> EngineListenerStats {
        self.counters.connected.store(false, Ordering::Relaxed);
        *self
            .counters
            .decoder
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = decoder.stats();
        self.handle().stats()
    }
}

/// `endpoint` with its port moved up by `rank` (unchanged for rank 0, or without a
/// parseable port, which `validate` then refuses).
fn offset_port(endpoint: &str, rank: u32) -> String {
    if rank == 0 {
        return endpoint.to_owned();
    }
    match endpoint.rsplit_once(':') {
        Some((host, port)) => match port.parse::<u32>() {
            Ok(p) => format!("{host}:{}", p.saturating_add(rank)),
            Err(_) => endpoint.to_owned(),
        },
        None => endpoint.to_owned(),
    }
}
