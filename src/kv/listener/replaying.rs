//! The listener's loop when the engine serves a replay endpoint: losses are repaired
//! from the engine's buffer ([`Repair`] decides), cleared only when it cannot cover.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::Instant as StdInstant;

use tokio::time::Instant;

use super::EngineListener;
use crate::counter;
use crate::kv::replay::{self, Repair, Step};
use crate::kv::stale::{Forwarded, ViewLoss};
use crate::kv::{
    PlacementEvent,
    engine::{EngineDecoder, EngineListenerStats},
};
use crate::net::{Backoff, RateLimitedWarn, random_unit};
use crate::wire::{Framed, Layout, SeqTracker};
use crate::zmtp::{self, DealerSocket, Message};

/// A replay connection being made and its request sent.
type Dial = Pin<Box<dyn Future<Output = Result<DealerSocket, zmtp::Error>> + Send>>;

/// The loop's state besides the sockets.
struct Loop {
    decoder: EngineDecoder,
    forwarded: Forwarded,
    repair: Repair,
    dealer: Option<DealerSocket>,
    /// The next replay's connection, dialled beside the live stream.
    dialing: Option<Dial>,
    warn: RateLimitedWarn,
}

/// Waits for the dial in progress; never ready without one.
async fn dialled(dialing: &mut Option<Dial>) -> Result<DealerSocket, zmtp::Error> {
    match dialing {
        Some(d) => d.await,
        None => std::future::pending().await,
    }
}

fn now() -> StdInstant {
    Instant::now().into_std()
}

/// Waits for the next message on the replay connection; never ready without one.
async fn recv_reply(dealer: &mut Option<DealerSocket>) -> Result<Message, zmtp::Error> {
    match dealer {
        Some(d) => d.recv().await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`, or forever.
async fn sleep_until(at: Option<StdInstant>) {
    match at {
        Some(at) => tokio::time::sleep_until(Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}

impl EngineListener {
    pub(super) async fn run_replaying(self, replay_endpoint: String) -> EngineListenerStats {
        let cancel = self.cancel.clone();
        let mut backoff = Backoff::checked(self.config.reconnect_min, self.config.reconnect_max);
        let mut state = Loop {
            decoder: self.decoder.clone(),
            forwarded: Forwarded::default(),
            repair: Repair::new(self.config.replay_limits),
            dealer: None,
            dialing: None,
            warn: RateLimitedWarn::default(),
        };
        let mut seq_tracker = SeqTracker::default();
        let mut connected_before = false;
        // While the engine is away: when what routers hold of it is cleared.
        let mut clear_at: Option<StdInstant> = None;
        let mut steps = Vec::new();
        loop {
            let connected = loop {
                tokio::select! {
                    () = cancel.cancelled() => return self.finish(&state.decoder),
                    r = self.connect() => break r,
                    () = sleep_until(clear_at) => {
                        clear_at = None;
                        if !self.disconnected_too_long(&mut state).await {
                            return self.finish(&state.decoder);
                        }
                    }
                }
            };
            let mut sub = match connected {
                Ok(s) => s,
                Err(e) => {
                    counter::add(&self.counters.connect_failures, 1);
                    if state.warn.check("connect", now()).is_some() {
                        tracing::warn!(endpoint = %self.config.endpoint, error = %crate::net::ErrorChain(&e), "engine connection failed; retrying with backoff");
                    }
                    let delay = backoff.next_delay(random_unit());
                    let until = Instant::now() + delay;
                    loop {
                        tokio::select! {
                            () = cancel.cancelled() => return self.finish(&state.decoder),
                            () = tokio::time::sleep_until(until) => break,
                            () = sleep_until(clear_at) => {
                                clear_at = None;
                                if !self.disconnected_too_long(&mut state).await {
                                    return self.finish(&state.decoder);
                                }
                            }
                        }
                    }
                    continue;
                }
            };
            self.connected(&mut connected_before, &mut backoff, &mut seq_tracker);
            state.repair.on_connect(now(), &mut steps);
            if !self
                .run_steps(&mut state, &mut steps, &replay_endpoint)
                .await
            {
                return self.finish(&state.decoder);
            }
            loop {
                let timeout = state.repair.poll_timeout();
                tokio::select! {
                    () = cancel.cancelled() => return self.finish(&state.decoder),
                    m = sub.recv() => {
                        let msg = match m {
                            Ok(m) => m,
                            Err(e) => {
                                if state.warn.check("recv", now()).is_some() {
                                    tracing::warn!(endpoint = %self.config.endpoint, error = %crate::net::ErrorChain(&e), "engine connection lost; reconnecting");
                                }
                                break;
                            }
                        };
                        let framed = Layout::TopicSeq.parse(Some(&self.config.topic), &msg);
                        let (Ok(Framed { sequence: Some(seq), payload: Some(payload), .. }), 3) =
                            (framed, msg.len())
                        else {
                            counter::add(&self.counters.malformed, 1);
                            continue;
                        };
                        // Counted as without replay; repaired below.
                        self.observe_seq(&mut seq_tracker, seq);
                        state.repair.on_live(now(), seq, payload, &mut steps);
                    }
                    r = dialled(&mut state.dialing), if state.dialing.is_some() => {
                        state.dialing = None;
                        match r {
                            Ok(dealer) => state.dealer = Some(dealer),
                            Err(e) => {
                                if state.warn.check("replay", now()).is_some() {
                                    tracing::warn!(endpoint = %replay_endpoint, error = %crate::net::ErrorChain(&e), "engine replay endpoint unreachable");
                                }
                                state.repair.on_unreachable(now(), &mut steps);
                            }
                        }
                    }
                    r = recv_reply(&mut state.dealer), if state.repair.replaying() => match r {
                        Ok(msg) => {
                            let reply = replay::parse_reply(&msg, &self.config.topic);
                            state.repair.on_reply(now(), reply, &mut steps);
                        }
                        Err(e) => {
                            tracing::debug!(endpoint = %replay_endpoint, error = %crate::net::ErrorChain(&e), "engine replay connection failed");
                            state.dealer = None;
                            state.repair.on_unreachable(now(), &mut steps);
                        }
                    },
                    () = sleep_until(timeout), if timeout.is_some() => {
                        state.repair.on_timeout(now(), &mut steps);
                    }
                }
                if !self
                    .run_steps(&mut state, &mut steps, &replay_endpoint)
                    .await
                {
                    return self.finish(&state.decoder);
                }
            }
            self.counters.connected.store(false, Ordering::Relaxed);
            clear_at = Some(now() + self.config.replay_limits.timeout);
            let delay = backoff.next_delay(random_unit());
            tokio::select! {
                () = cancel.cancelled() => return self.finish(&state.decoder),
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// The engine has been away for the replay timeout: routers drop what they hold of
    /// it, and the next connection replays everything the engine still buffers.
    async fn disconnected_too_long(&self, state: &mut Loop) -> bool {
        state.repair.forget();
        let clears = self.clears(
            ViewLoss::Disconnected,
            &mut state.forwarded,
            &mut state.decoder,
            &state.warn,
        );
        self.forward(clears, &mut state.forwarded).await
    }

    /// Carries out `steps` (and those they lead to) in order; `false` when the
    /// listener must stop.
    async fn run_steps(&self, state: &mut Loop, steps: &mut Vec<Step>, endpoint: &str) -> bool {
        let mut pending: Vec<PlacementEvent> = Vec::new();
        for step in std::mem::take(steps) {
            match step {
                Step::Request(from) => {
                    state.dealer = None;
                    state.dialing = Some(self.dial(endpoint, from));
                }
                Step::Disconnect => {
                    state.dealer = None;
                    state.dialing = None;
                }
                Step::Clear(cause) => pending.extend(self.clears(
                    ViewLoss::Unrepaired(cause),
                    &mut state.forwarded,
                    &mut state.decoder,
                    &state.warn,
                )),
                Step::Apply { payload, .. } => {
                    let before = state.decoder.stats();
                    let decoded = state.decoder.decode_batch(&payload);
                    let after = state.decoder.stats();
                    *self
                        .counters
                        .decoder
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = after;
                    if after.malformed_batches > before.malformed_batches
                        || after.failed_removals > before.failed_removals
                    {
                        // The clears come first: what this batch says is what the
                        // engine holds after the loss.
                        pending.extend(self.clears(
                            ViewLoss::Undecodable,
                            &mut state.forwarded,
                            &mut state.decoder,
                            &state.warn,
                        ));
                        pending.extend(decoded.unwrap_or_default());
                        renumber(&mut pending);
                    } else {
                        pending.extend(decoded.unwrap_or_default());
                    }
                    if !self
                        .forward(std::mem::take(&mut pending), &mut state.forwarded)
                        .await
                    {
                        return false;
                    }
                }
            }
        }
        *self
            .counters
            .replay
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = state.repair.stats();
        self.forward(pending, &mut state.forwarded).await
    }

    /// Dials the replay endpoint and sends a request from `from`, on a connection of
    /// its own, within the replay timeout; run beside the live stream.
    fn dial(&self, endpoint: &str, from: u64) -> Dial {
        let endpoint = endpoint.to_owned();
        let config = self.config.zmtp.clone();
        let timeout = self.config.replay_limits.timeout;
        tracing::debug!(endpoint = %endpoint, from, "asking the engine to replay");
        Box::pin(async move {
            let dial = async {
                let mut dealer = DealerSocket::connect(&endpoint, config).await?;
                dealer.send(&replay::request(from)).await?;
                Ok::<_, zmtp::Error>(dealer)
            };
            tokio::time::timeout(timeout, dial)
                .await
                .map_err(|_| zmtp::Error::Timeout(zmtp::TimeoutKind::Connect))?
        })
    }
}

/// Raw ids in list order: a clear decided after its batch was decoded took a later
/// id, so the processor would see it jump.
fn renumber(events: &mut [PlacementEvent]) {
    let first = events.iter().map(|e| e.event.id).min().unwrap_or(0);
    for (id, ev) in (first..).zip(events.iter_mut()) {
        ev.event.id = id;
    }
}
