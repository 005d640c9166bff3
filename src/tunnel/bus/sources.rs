//! The bus's announced sources (DESIGN §7.4): which session serves which publisher,
//! and the discovery view a `DynamicSubscriber` follows them with.
//!
//! The view is an in-memory discovery backend the bus alone writes: a source's
//! announcement registers its publisher (a new incarnation each time), a withdrawal or
//! the end of its session removes it. Readers get the watch contract of every backend.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::discovery::{
    BoxFuture, ChannelId, Discovery, DiscoveryError, DiscoveryStats, DiscoveryStream, Instance,
    MemoryDiscovery, Query, Registration, Transport, WorkerIdentity,
};
use crate::tunnel::protocol::announce::AnnouncedSource;
use crate::tunnel::protocol::codes::{AnnounceRefusal, CodeCounts};
use crate::wire::Dialect;

/// One announced publisher: the session serving it (`C`, its command queue), and
/// its registration in the view of its wire.
struct Held<C> {
    client_id: String,
    session_id: u64,
    commands: C,
    _registration: Registration,
}

/// The credential a channel is bound to, and since when its session is gone.
struct Binding {
    client_id: String,
    released: Option<Instant>,
}

/// What the table holds, under one lock.
struct State<C> {
    held: HashMap<ChannelId, Held<C>>,
    /// Each announced channel's credential (held ones, and those released within the
    /// hold): at most twice the table's `max`; past it a credential's new channel
    /// takes the place of its own oldest released one, or is refused `bus_full`.
    bound: HashMap<ChannelId, Binding>,
    /// The channel each session announces each of its publisher ids under.
    of_session: HashMap<(u64, u64), ChannelId>,
    /// Channels held per client id.
    per_client: HashMap<String, usize>,
}

impl<C> State<C> {
    /// Removes `id`'s holder; its binding is released now (`Some`) or dropped.
    fn remove(&mut self, id: &ChannelId, released: Option<Instant>) -> Option<Held<C>> {
        let held = self.held.remove(id)?;
        self.of_session
            .remove(&(held.session_id, id.publisher_id()));
        if let Some(n) = self.per_client.get_mut(&held.client_id) {
            *n -= 1;
            if *n == 0 {
                self.per_client.remove(&held.client_id);
            }
        }
        match released {
            Some(at) => {
                if let Some(b) = self.bound.get_mut(id) {
                    b.released = Some(at);
                }
            }
            None => {
                self.bound.remove(id);
            }
        }
        Some(held)
    }
}

/// How the table is bounded.
pub(crate) struct SourceLimits {
    /// Most publishers announced on the bus at once.
    pub(crate) max: usize,
    /// Source credentials configured (each is sure of `max / sources`).
    pub(crate) sources: usize,
    /// How long a lost session's channels stay bound to its credential.
    pub(crate) hold: Duration,
    /// Events each watcher of a view may have waiting before it is resynced.
    pub(crate) watch_buffer: usize,
}

/// Which session serves which announced publisher (by channel: a namespace the
/// announcing credential was granted is part of the key), and one view per wire
/// layout (a subscriber reads one).
pub(crate) struct SourceTable<C> {
    ours: MemoryDiscovery,
    dynamo: MemoryDiscovery,
    state: Mutex<State<C>>,
    max: usize,
    /// What each source credential is sure of.
    share: usize,
    sources: usize,
    hold: Duration,
    /// One announcement at a time, from check to registration to record: two
    /// sessions claiming one channel never both touch the view.
    announcing: tokio::sync::Mutex<()>,
    /// Announcements refused, by [`AnnounceRefusal`].
    pub(crate) refused: CodeCounts,
    /// Refusals warn once a minute per reason (a hostile source repeats them).
    warn: crate::net::RateLimitedWarn,
}

/// Where to subscribe to an announced publisher.
pub(crate) struct Route<C> {
    pub(crate) session_id: u64,
    pub(crate) commands: C,
}

impl<C: Clone> SourceTable<C> {
    pub(crate) fn new(limits: SourceLimits) -> SourceTable<C> {
        let view = || {
            MemoryDiscovery::builder()
                .watch_buffer(limits.watch_buffer.max(1))
                .build()
                .unwrap_or_default()
        };
        let sources = limits.sources.max(1);
        SourceTable {
            ours: view(),
            dynamo: view(),
            state: Mutex::new(State {
                held: HashMap::new(),
                bound: HashMap::new(),
                of_session: HashMap::new(),
                per_client: HashMap::new(),
            }),
            max: limits.max,
            share: (limits.max / sources).max(1),
            sources,
            hold: limits.hold,
            announcing: tokio::sync::Mutex::new(()),
            refused: CodeCounts::default(),
            warn: crate::net::RateLimitedWarn::default(),
        }
    }

    fn of(&self, wire: Dialect) -> &MemoryDiscovery {
        match wire {
            Dialect::Dynamo => &self.dynamo,
            _ => &self.ours,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State<C>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why session `session_id` of `client_id` may not take `id` now, if it may not:
    /// another credential holds it (or held it within the hold), a newer session of
    /// the same client does, or the bus (or this credential's share) is full.
    fn refusal(
        &self,
        state: &State<C>,
        id: &ChannelId,
        client_id: &str,
        session_id: u64,
        now: Instant,
    ) -> Option<AnnounceRefusal> {
        match state.held.get(id) {
            Some(h) if h.client_id != client_id => {
                return Some(AnnounceRefusal::HeldByAnotherSource);
            }
            Some(h) if h.session_id > session_id => {
                return Some(AnnounceRefusal::SupersededSession);
            }
            Some(_) => return None,
            None => {}
        }
        if let Some(b) = state.bound.get(id) {
            let held_lately = b
                .released
                .is_none_or(|at| now.saturating_duration_since(at) < self.hold);
            if b.client_id != client_id && held_lately {
                return Some(AnnounceRefusal::HeldByAnotherSource);
            }
        }
        // The same publisher under another channel of this session: a move, no room.
        if state
            .of_session
            .contains_key(&(session_id, id.publisher_id()))
        {
            return None;
        }
        let total = state.held.len();
        if total >= self.max {
            return Some(AnnounceRefusal::BusFull);
        }
        let mine = state.per_client.get(client_id).copied().unwrap_or(0);
        if mine >= self.share {
            // What the other credentials' shares still need.
            let others_present = state.per_client.keys().filter(|c| *c != client_id).count();
            let absent = self.sources.saturating_sub(1 + others_present);
            let reserved: usize = state
                .per_client
                .iter()
                .filter(|(c, _)| *c != client_id)
                .map(|(_, n)| self.share.saturating_sub(*n))
                .sum::<usize>()
                + absent * self.share;
            if total + 1 + reserved > self.max {
                return Some(AnnounceRefusal::BusFull);
            }
        }
        None
    }

    /// Session `session_id` of `client_id` announced `sources`: each is registered as
    /// a new incarnation (one announced under a new channel leaves its old one), unless
    /// refused (counted by reason, warned once a minute by reason). Returns the
    /// refused announcements, with why.
    pub(crate) async fn announce(
        &self,
        session_id: u64,
        client_id: &str,
        commands: &C,
        sources: Vec<AnnouncedSource>,
    ) -> Vec<(AnnounceRefusal, AnnouncedSource)> {
        let _one_at_a_time = self.announcing.lock().await;
        let mut refusals = Vec::new();
        for source in sources {
            // The decoder checked it.
            let Ok(id) = source.channel_id() else {
                continue;
            };
            let now = Instant::now();
            let refused = {
                let mut state = self.state();
                self.refusal(&state, &id, client_id, session_id, now)
                    .or_else(|| {
                        // A new binding needs room among the bindings.
                        let bound = state.bound.contains_key(&id);
                        (!bound && !self.room_to_bind(&mut state, client_id, now))
                            .then_some(AnnounceRefusal::BusFull)
                    })
            };
            if let Some(why) = refused {
                // The session no longer announces this publisher under any channel.
                let earlier = self.leave(session_id, id.publisher_id(), None);
                drop(earlier);
                self.refused.add(why.as_str());
                if let Some(suppressed) = self.warn.check(why.as_str(), now) {
                    tracing::warn!(%client_id, %id, reason = %why, suppressed, "an announced publisher was refused (the source is told)");
                }
                refusals.push((why, source));
                continue;
            }
            let transport = Transport::announced(client_id, session_id);
            let mut instance = Instance::new(id.clone(), transport.clone(), 0);
            instance.worker = source.worker;
            if source.recovery {
                // Reached through the same session (`EventBus::open_recovery`).
                instance.recovery = Some(transport.endpoint().to_owned());
            }
            let registered = self.of(source.dialect).register_instance(instance).await;
            let Ok(registration) = registered else {
                continue;
            };
            // Dropping an earlier registration removes only its incarnation.
            let mut earlier = Vec::new();
            {
                let mut state = self.state();
                let state = &mut *state;
                // Its old channel, if this session announced the publisher elsewhere.
                if let Some(old) = state
                    .of_session
                    .get(&(session_id, id.publisher_id()))
                    .filter(|old| **old != id)
                    .cloned()
                {
                    earlier.extend(state.remove(&old, None));
                }
                earlier.extend(state.remove(&id, Some(now)));
                state.held.insert(
                    id.clone(),
                    Held {
                        client_id: client_id.to_owned(),
                        session_id,
                        commands: commands.clone(),
                        _registration: registration,
                    },
                );
                state
                    .of_session
                    .insert((session_id, id.publisher_id()), id.clone());
                *state.per_client.entry(client_id.to_owned()).or_default() += 1;
                state.bound.insert(
                    id,
                    Binding {
                        client_id: client_id.to_owned(),
                        released: None,
                    },
                );
            }
            drop(earlier);
        }
        refusals
    }

    /// Whether `client_id` may bind one more channel: the bindings stay under twice
    /// `max`. Those released longer than the hold ago go first, then `client_id`'s own
    /// oldest released; never another credential's within its hold (a source churning
    /// channels would strip the others' holds).
    fn room_to_bind(&self, state: &mut State<C>, client_id: &str, now: Instant) -> bool {
        if state.bound.len() < 2 * self.max {
            return true;
        }
        let hold = self.hold;
        state.bound.retain(|_, b| {
            b.released
                .is_none_or(|at| now.saturating_duration_since(at) < hold)
        });
        if state.bound.len() < 2 * self.max {
            return true;
        }
        let own_oldest = state
            .bound
            .iter()
            .filter(|(_, b)| b.client_id == client_id)
            .filter_map(|(id, b)| b.released.map(|at| (at, id.clone())))
            .min_by_key(|(at, _)| *at);
        match own_oldest {
            Some((_, id)) => state.bound.remove(&id).is_some(),
            None => false,
        }
    }

    /// Session `session_id` no longer announces `publisher_id`: its channel is
    /// removed, and released (`Some`: lost) or free at once (`None`: withdrawn).
    fn leave(
        &self,
        session_id: u64,
        publisher_id: u64,
        released: Option<Instant>,
    ) -> Option<Held<C>> {
        let mut state = self.state();
        let id = state.of_session.get(&(session_id, publisher_id)).cloned()?;
        state.remove(&id, released)
    }

    /// Session `session_id` withdrew `publisher_ids` (those it holds are removed, and
    /// their channels free at once).
    pub(crate) fn withdraw(&self, session_id: u64, publisher_ids: &[u64]) {
        let gone: Vec<Held<C>> = publisher_ids
            .iter()
            .filter_map(|p| self.leave(session_id, *p, None))
            .collect();
        drop(gone);
    }

    /// Session `session_id` ended: every publisher it holds is removed (its channels
    /// stay bound to its credential for the hold).
    pub(crate) fn session_ended(&self, session_id: u64) {
        let now = Instant::now();
        let gone: Vec<Held<C>> = {
            let mut state = self.state();
            let ids: Vec<ChannelId> = state
                .held
                .iter()
                .filter(|(_, h)| h.session_id == session_id)
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter()
                .filter_map(|id| state.remove(id, Some(now)))
                .collect()
        };
        drop(gone);
    }

    /// The session serving channel `id` now.
    pub(crate) fn route(&self, id: &ChannelId) -> Option<Route<C>> {
        self.state().held.get(id).map(|h| Route {
            session_id: h.session_id,
            commands: h.commands.clone(),
        })
    }

    /// Publishers announced now.
    pub(crate) fn len(&self) -> usize {
        self.state().held.len()
    }

    /// The read-only discovery view of the publishers announced with `wire`.
    pub(crate) fn view(&self, wire: Dialect) -> AnnouncedView {
        AnnouncedView {
            view: self.of(wire).clone(),
        }
    }
}

/// The publishers sources announced on an [`EventBus`](crate::tunnel::EventBus) with one wire
/// layout, as a [`Discovery`] (from [`EventBus::announced`](crate::tunnel::EventBus::announced)):
/// follow it with a `DynamicSubscriber` built with `.tunnel(bus)` and that wire's
/// layout.
///
/// Read-only: only sources announce (`register` is refused). A source's session
/// ending removes its publishers; announced again (a reconnect), each is a new
/// incarnation.
#[derive(Debug, Clone)]
pub struct AnnouncedView {
    view: MemoryDiscovery,
}

impl Discovery for AnnouncedView {
    fn register_with(
        &self,
        _: ChannelId,
        _: Transport,
        _: Option<WorkerIdentity>,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        Box::pin(async move {
            Err(DiscoveryError::Unsupported {
                operation: "registering in a bus's announced sources (only sources announce)",
            })
        })
    }

    fn list(&self, query: Query) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>> {
        self.view.list(query)
    }

    fn watch(
        &self,
        query: Query,
        cancel: CancellationToken,
    ) -> BoxFuture<'_, Result<DiscoveryStream, DiscoveryError>> {
        self.view.watch(query, cancel)
    }

    fn stats(&self) -> DiscoveryStats {
        self.view.stats()
    }
}
