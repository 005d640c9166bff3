//! What the event bus keeps per session and stream (DESIGN §7.3): the commands a
//! session task takes, the session table's entries, waiting and open streams, and
//! the bus's counters.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::tunnel::DrainReason;
use crate::tunnel::bus::auth::Identity;
use crate::tunnel::error::TunnelError;
use crate::tunnel::io::{StreamBytes, TunnelStream};
use crate::tunnel::protocol::announce::{Role, Target};
use crate::tunnel::protocol::codes::CodeCounts;

/// Commands a session task takes from the rest of the bus.
pub(crate) enum Command {
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

pub(crate) struct Entry {
    pub(crate) session_id: u64,
    /// A broker, or a source (which serves only what it announces).
    pub(crate) role: Role,
    /// The credential it authenticated with.
    pub(crate) identity: Identity,
    /// The HTTP/2 connection the session runs on: its data streams must come on it.
    pub(crate) conn_id: u64,
    pub(crate) namespaces: Vec<String>,
    pub(crate) commands: mpsc::Sender<Command>,
    /// Welcomed and not draining.
    pub(crate) available: Arc<AtomicBool>,
    /// Under its stream limit.
    pub(crate) room: Arc<AtomicBool>,
    /// Its data streams the router let go of (each at most once), for the session to
    /// unsubscribe: never lost, never more than its streams.
    pub(crate) detached: Arc<Detached>,
    /// Cancelled when the session ends: its data streams end with it.
    pub(crate) ended: CancellationToken,
}

impl Entry {
    /// Whether this session takes streams for `namespace` (welcomed, covering it,
    /// not draining); it may still be full ([`has_room`](Self::has_room)).
    pub(crate) fn serves(&self, namespace: &str) -> bool {
        self.role == Role::Broker
            && self.available.load(Ordering::Relaxed)
            && self.namespaces.iter().any(|n| n == namespace)
    }

    /// Whether it is under its stream limit.
    pub(crate) fn has_room(&self) -> bool {
        self.room.load(Ordering::Relaxed)
    }
}

/// Data streams of one session that the router dropped: each pushes its id once, the
/// session task takes them and unsubscribes. Bounded by the session's streams.
#[derive(Debug, Default)]
pub(crate) struct Detached {
    ids: Mutex<Vec<u64>>,
    pub(crate) notify: tokio::sync::Notify,
}

impl Detached {
    pub(crate) fn push(&self, stream_id: u64) {
        self.ids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(stream_id);
        self.notify.notify_one();
    }

    pub(crate) fn take(&self) -> Vec<u64> {
        std::mem::take(&mut *self.ids.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

pub(crate) struct Waiter {
    pub(crate) session_id: u64,
    pub(crate) namespace: String,
    pub(crate) publisher_id: u64,
    /// Whether it moves to a broker that joins and owns its publisher (a recovery
    /// stream, short-lived and not to be restarted, does not).
    pub(crate) movable: bool,
    pub(crate) reply: oneshot::Sender<Result<TunnelStream, TunnelError>>,
}

/// An open data stream, for moving it when its publisher's owner changes.
pub(crate) struct OpenStream {
    pub(crate) namespace: String,
    pub(crate) publisher_id: u64,
    pub(crate) client_id: String,
    /// See [`Waiter::movable`].
    pub(crate) movable: bool,
    /// Ends the stream (both bodies) when cancelled.
    pub(crate) stop: CancellationToken,
}

/// The bus's counters (read into `BusStats`).
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) sessions_started: AtomicU64,
    pub(crate) superseded: AtomicU64,
    pub(crate) unauthorized: AtomicU64,
    pub(crate) denied: CodeCounts,
    pub(crate) pending_evicted: AtomicU64,
    pub(crate) pending_timeouts: AtomicU64,
    pub(crate) connections_refused: AtomicU64,
    pub(crate) bad_targets: AtomicU64,
    pub(crate) streams_opened: AtomicU64,
    pub(crate) streams_failed: AtomicU64,
    pub(crate) unknown_streams: AtomicU64,
    pub(crate) streams_moved: AtomicU64,
    pub(crate) fallbacks: AtomicU64,
    pub(crate) refused: CodeCounts,
    pub(crate) closed: CodeCounts,
    pub(crate) bytes: Arc<StreamBytes>,
}
