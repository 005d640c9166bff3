//! The bus's announced sources (DESIGN §7.4): which session serves which publisher,
//! and the discovery view a `DynamicSubscriber` follows them with.
//!
//! The view is an in-memory discovery backend the bus alone writes: a source's
//! announcement registers its publisher (a new incarnation each time), a withdrawal or
//! the end of its session removes it. Readers get the watch contract of every backend.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio_util::sync::CancellationToken;

use super::announce::AnnouncedSource;
use super::codes::CodeCounts;
use crate::discovery::{
    BoxFuture, ChannelId, Discovery, DiscoveryError, DiscoveryStats, DiscoveryStream, Instance,
    MemoryDiscovery, Query, Registration, Transport, WorkerIdentity,
};
use crate::wire::Wire;

/// One announced publisher: the session serving it (`C`, its command queue), and
/// its registration in the view of its wire.
struct Held<C> {
    client_id: String,
    session_id: u64,
    commands: C,
    _registration: Registration,
}

/// Which session serves which announced publisher (by channel: a namespace the
/// announcing credential was granted is part of the key), and one view per wire
/// layout (a subscriber reads one).
pub(super) struct SourceTable<C> {
    ours: MemoryDiscovery,
    dynamo: MemoryDiscovery,
    held: Mutex<HashMap<ChannelId, Held<C>>>,
    /// Most publishers announced on the bus at once.
    max: usize,
    /// One announcement at a time, from check to registration to record: two
    /// sessions claiming one channel never both touch the view.
    announcing: tokio::sync::Mutex<()>,
    /// Announcements ignored, by reason: `held_by_another_source`,
    /// `superseded_session`, `bus_full`.
    pub(super) refused: CodeCounts,
    /// Refusals warn once a minute per reason (a hostile source repeats them).
    warn: crate::net::RateLimitedWarn,
}

/// Where to subscribe to an announced publisher.
pub(super) struct Route<C> {
    pub(super) session_id: u64,
    pub(super) commands: C,
}

impl<C: Clone> SourceTable<C> {
    /// At most `max` publishers; each view's watchers buffer up to `watch_buffer`
    /// events before resyncing.
    pub(super) fn new(max: usize, watch_buffer: usize) -> SourceTable<C> {
        let view = || {
            MemoryDiscovery::builder()
                .watch_buffer(watch_buffer.max(1))
                .build()
                .unwrap_or_default()
        };
        SourceTable {
            ours: view(),
            dynamo: view(),
            held: Mutex::new(HashMap::new()),
            max,
            announcing: tokio::sync::Mutex::new(()),
            refused: CodeCounts::default(),
            warn: crate::net::RateLimitedWarn::default(),
        }
    }

    fn of(&self, wire: Wire) -> &MemoryDiscovery {
        match wire {
            Wire::Dynamo => &self.dynamo,
            _ => &self.ours,
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<ChannelId, Held<C>>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why session `session_id` of `client_id` may not take `id` now, if it may not:
    /// another client holds it, a newer session of the same client does, or the bus
    /// holds its `max` already.
    fn refusal(&self, id: &ChannelId, client_id: &str, session_id: u64) -> Option<&'static str> {
        let held = self.held();
        match held.get(id) {
            Some(h) if h.client_id != client_id => Some("held_by_another_source"),
            Some(h) if h.session_id > session_id => Some("superseded_session"),
            None if held.len() >= self.max => Some("bus_full"),
            _ => None,
        }
    }

    /// Session `session_id` of `client_id` announced `sources`: each is registered as
    /// a new incarnation, unless refused (counted by reason, warned once a minute by
    /// reason).
    pub(super) async fn announce(
        &self,
        session_id: u64,
        client_id: &str,
        commands: &C,
        sources: Vec<AnnouncedSource>,
    ) {
        let _one_at_a_time = self.announcing.lock().await;
        for source in sources {
            // The decoder checked it.
            let Ok(id) = source.channel_id() else {
                continue;
            };
            if let Some(why) = self.refusal(&id, client_id, session_id) {
                self.refused.add(why);
                if let Some(suppressed) = self.warn.check(why, std::time::Instant::now()) {
                    tracing::warn!(%client_id, %id, reason = why, suppressed, "an announced publisher was refused");
                }
                continue;
            }
            let transport = Transport::announced(client_id, session_id);
            let mut instance = Instance::new(id.clone(), transport.clone(), 0);
            instance.worker = source.worker;
            if source.recovery {
                // Reached through the same session (`EventBus::open_recovery`).
                instance.recovery = Some(transport.endpoint().to_owned());
            }
            let registered = self.of(source.wire).register_instance(instance).await;
            let Ok(registration) = registered else {
                continue;
            };
            // Dropping the earlier holder's registration removes only its incarnation.
            let earlier = self.held().insert(
                id,
                Held {
                    client_id: client_id.to_owned(),
                    session_id,
                    commands: commands.clone(),
                    _registration: registration,
                },
            );
            drop(earlier);
        }
    }

    /// Session `session_id` withdrew `publisher_ids` (those it holds are removed).
    pub(super) fn withdraw(&self, session_id: u64, publisher_ids: &[u64]) {
        let gone: Vec<Held<C>> = {
            let mut held = self.held();
            let mine: Vec<ChannelId> = held
                .iter()
                .filter(|(id, h)| {
                    h.session_id == session_id && publisher_ids.contains(&id.publisher_id())
                })
                .map(|(id, _)| id.clone())
                .collect();
            mine.iter().filter_map(|id| held.remove(id)).collect()
        };
        drop(gone);
    }

    /// Session `session_id` ended: every publisher it holds is removed.
    pub(super) fn session_ended(&self, session_id: u64) {
        let gone: Vec<Held<C>> = {
            let mut held = self.held();
            let ids: Vec<ChannelId> = held
                .iter()
                .filter(|(_, h)| h.session_id == session_id)
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| held.remove(id)).collect()
        };
        drop(gone);
    }

    /// The session serving channel `id` now.
    pub(super) fn route(&self, id: &ChannelId) -> Option<Route<C>> {
        self.held().get(id).map(|h| Route {
            session_id: h.session_id,
            commands: h.commands.clone(),
        })
    }

    /// Publishers announced now.
    pub(super) fn len(&self) -> usize {
        self.held().len()
    }

    /// The read-only discovery view of the publishers announced with `wire`.
    pub(super) fn view(&self, wire: Wire) -> AnnouncedView {
        AnnouncedView {
            view: self.of(wire).clone(),
        }
    }
}

/// The publishers sources announced on an [`EventBus`](super::EventBus) with one wire
/// layout, as a [`Discovery`] (from [`EventBus::announced`](super::EventBus::announced)):
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
