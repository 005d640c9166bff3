//! What the event bus keeps per session and stream (DESIGN §7.3): the commands a
//! session task takes, the session table's entries, waiting and open streams, and
//! the bus's counters.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::DrainReason;
use super::announce::{Role, Target};
use super::auth::Identity;
use super::codes::CodeCounts;
use super::error::TunnelError;
use super::io::{StreamBytes, TunnelStream};

/// Commands a session task takes from the rest of the bus.
pub(super) enum Command {
    Subscribe {
        stream_id: u64,
        target: Target,
    },
    Drain {
        deadline: Duration,
        reason: DrainReason,
    },
    Attach {
        stream_id: u64,
        reply: oneshot::Sender<bool>,
    },
    Close,
}

pub(super) struct Entry {
    pub(super) session_id: u64,
    /// A broker, or a source (which serves only what it announces).
    pub(super) role: Role,
    /// The credential it authenticated with.
    pub(super) identity: Identity,
    /// The HTTP/2 connection the session runs on: its data streams must come on it.
    pub(super) conn_id: u64,
    pub(super) namespaces: Vec<String>,
    pub(super) commands: mpsc::Sender<Command>,
    /// Welcomed and not draining.
    pub(super) available: Arc<AtomicBool>,
    /// Under its stream limit.
    pub(super) room: Arc<AtomicBool>,
    /// Its data streams the router let go of (each at most once), for the session to
    /// unsubscribe: never lost, never more than its streams.
    pub(super) detached: Arc<Detached>,
    /// Cancelled when the session ends: its data streams end with it.
    pub(super) ended: CancellationToken,
}

impl Entry {
    /// Whether this session takes streams for `namespace` (welcomed, covering it,
    /// not draining); it may still be full ([`has_room`](Self::has_room)).
    pub(super) fn serves(&self, namespace: &str) -> bool {
        self.role == Role::Broker
            && self.available.load(Ordering::Relaxed)
            && self.namespaces.iter().any(|n| n == namespace)
    }

    /// Whether it is under its stream limit.
    pub(super) fn has_room(&self) -> bool {
        self.room.load(Ordering::Relaxed)
    }
}

/// Data streams of one session that the router dropped: each pushes its id once, the
/// session task takes them and unsubscribes. Bounded by the session's streams.
#[derive(Debug, Default)]
pub(super) struct Detached {
    ids: Mutex<Vec<u64>>,
    pub(super) notify: tokio::sync::Notify,
}

impl Detached {
    pub(super) fn push(&self, stream_id: u64) {
        self.ids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(stream_id);
        self.notify.notify_one();
    }

    pub(super) fn take(&self) -> Vec<u64> {
        std::mem::take(&mut *self.ids.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

pub(super) struct Waiter {
    pub(super) session_id: u64,
    pub(super) namespace: String,
    pub(super) publisher_id: u64,
    /// Whether it moves to a broker that joins and owns its publisher (a recovery
    /// stream, short-lived and not to be restarted, does not).
    pub(super) movable: bool,
    pub(super) reply: oneshot::Sender<Result<TunnelStream, TunnelError>>,
}

/// An open data stream, for moving it when its publisher's owner changes.
pub(super) struct OpenStream {
    pub(super) namespace: String,
    pub(super) publisher_id: u64,
    pub(super) client_id: String,
    /// See [`Waiter::movable`].
    pub(super) movable: bool,
    /// Ends the stream (both bodies) when cancelled.
    pub(super) stop: CancellationToken,
}

/// The bus's counters (read into `BusStats`).
#[derive(Default)]
pub(super) struct Counters {
    pub(super) sessions_started: AtomicU64,
    pub(super) superseded: AtomicU64,
    pub(super) unauthorized: AtomicU64,
    pub(super) denied: CodeCounts,
    pub(super) pending_evicted: AtomicU64,
    pub(super) pending_timeouts: AtomicU64,
    pub(super) connections_refused: AtomicU64,
    pub(super) bad_targets: AtomicU64,
    pub(super) streams_opened: AtomicU64,
    pub(super) streams_failed: AtomicU64,
    pub(super) unknown_streams: AtomicU64,
    pub(super) streams_moved: AtomicU64,
    pub(super) fallbacks: AtomicU64,
    pub(super) refused: CodeCounts,
    pub(super) closed: CodeCounts,
    pub(super) bytes: Arc<StreamBytes>,
}
