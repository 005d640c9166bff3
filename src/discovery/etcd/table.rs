//! The local registration table: what this backend registered (re-put under a new
//! lease after a loss), and the work handed to the session task (guard drops,
//! detaches, futures dropped part-way).

use std::collections::HashMap;

use crate::discovery::ChannelId;

#[derive(Debug)]
pub(super) struct Session {
    pub(super) lease: i64,
    pub(super) regs: HashMap<ChannelId, LocalReg>,
}

#[derive(Debug, Clone)]
pub(super) struct LocalReg {
    pub(super) serial: u64,
    pub(super) key: String,
    pub(super) value: String,
    /// A record written beside the key, under the same lease and revision (Dynamo's
    /// `event_sources`): key and value.
    pub(super) companion: Option<(String, String)>,
    /// The key's current `mod_revision` (changes when the key is put again).
    pub(super) revision: i64,
}

/// Work handed to the session task by code that cannot wait for etcd: guard drops,
/// detaches, and futures dropped (or failed) part-way through a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum PendingKind {
    /// A dropped guard, or an `unregister` dropped before it took the registration out
    /// of the table: unregister it.
    Release,
    /// Move the registration to its own lease.
    Detach,
    /// An `unregister` dropped (or failed) after it took the registration out of the
    /// table: delete `key` if it still holds that incarnation (`mod_revision`).
    Delete { key: String, revision: i64 },
    /// A `register` dropped (or failed) while its put under `lease` was in flight, so
    /// etcd may or may not have applied it: take back what it may have left (see
    /// [`Shared::clean_abandoned`]). `rechecked` once that was looked at twice.
    Abandoned {
        key: String,
        lease: i64,
        rechecked: bool,
    },
}

#[derive(Debug)]
pub(super) struct PendingOp {
    pub(super) id: ChannelId,
    /// The registration's serial (for `Abandoned`, the serial the register took).
    pub(super) serial: u64,
    pub(super) kind: PendingKind,
}
