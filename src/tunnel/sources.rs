//! The bus's announced sources (DESIGN §7.5): which session serves which publisher,
//! and the discovery view a `DynamicSubscriber` follows them with.
//!
//! The view is an in-memory discovery backend the bus alone writes: a source's
//! announcement registers its publisher (a new incarnation each time), a withdrawal or
//! the end of its session removes it. Readers get the watch contract of every backend.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio_util::sync::CancellationToken;

use super::announce::AnnouncedSource;
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

/// Which session serves which announced publisher, and one view per wire layout (a
/// subscriber reads one).
pub(super) struct SourceTable<C> {
    ours: MemoryDiscovery,
    dynamo: MemoryDiscovery,
    held: Mutex<HashMap<u64, Held<C>>>,
    /// Announcements ignored: another client's session holds the publisher id.
    pub(super) conflicts: AtomicU64,
}

/// Where to subscribe to an announced publisher.
pub(super) struct Route<C> {
    pub(super) session_id: u64,
    pub(super) commands: C,
}

impl<C: Clone> SourceTable<C> {
    /// Each view's watchers buffer up to `watch_buffer` events before resyncing.
    pub(super) fn new(watch_buffer: usize) -> SourceTable<C> {
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
            conflicts: AtomicU64::new(0),
        }
    }

    fn of(&self, wire: Wire) -> &MemoryDiscovery {
        match wire {
            Wire::Dynamo => &self.dynamo,
            _ => &self.ours,
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Held<C>>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Session `session_id` of `client_id` announced `sources`: each is registered
    /// as a new incarnation, unless another client's session holds its id (ignored,
    /// counted in `conflicts`).
    pub(super) async fn announce(
        &self,
        session_id: u64,
        client_id: &str,
        commands: &C,
        sources: Vec<AnnouncedSource>,
    ) {
        for source in sources {
            let taken = self
                .held()
                .get(&source.publisher_id)
                .is_some_and(|h| h.client_id != client_id);
            if taken {
                self.conflicts.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%client_id, publisher_id = source.publisher_id, "a source announced a publisher id another source holds: ignored");
                continue;
            }
            // The decoder checked it.
            let Ok(id) = source.channel_id() else {
                continue;
            };
            let registered = self
                .of(source.wire)
                .register_with(
                    id,
                    Transport::announced(client_id, session_id),
                    source.worker,
                )
                .await;
            let Ok(registration) = registered else {
                continue;
            };
            // Dropping the earlier holder's registration removes only its incarnation.
            let earlier = self.held().insert(
                source.publisher_id,
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
            let mine: Vec<u64> = publisher_ids
                .iter()
                .copied()
                .filter(|id| held.get(id).is_some_and(|h| h.session_id == session_id))
                .collect();
            mine.iter().filter_map(|id| held.remove(id)).collect()
        };
        drop(gone);
    }

    /// Session `session_id` ended: every publisher it holds is removed.
    pub(super) fn session_ended(&self, session_id: u64) {
        let gone: Vec<Held<C>> = {
            let mut held = self.held();
            let ids: Vec<u64> = held
                .iter()
                .filter(|(_, h)| h.session_id == session_id)
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| held.remove(id)).collect()
        };
        drop(gone);
    }

    /// The session serving `publisher_id` now.
    pub(super) fn route(&self, publisher_id: u64) -> Option<Route<C>> {
        self.held().get(&publisher_id).map(|h| Route {
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
