//! What a source serves its data streams from: an announced publisher's socket, or
//! its worker's recovery endpoint.

use std::{fmt, sync::Arc};

use crate::tunnel::io::TunnelStream;
use crate::tunnel::protocol::announce::AnnouncedSource;
use crate::zmtp::StreamAcceptor;

/// What serves an announced publisher's recovery streams: its worker's recovery
/// endpoint ([`RecoveryServer::acceptor`](crate::kv::pipeline::RecoveryServer::acceptor)
/// returns one), handed to [`Source::announce_with_recovery`](crate::tunnel::Source::announce_with_recovery).
pub trait RecoveryStreams: fmt::Debug + Send + Sync + 'static {
    /// Serves one router over `stream`; `false` when refused.
    fn accept(&self, stream: TunnelStream) -> bool;
    /// Whether it accepts nothing more (its server was dropped).
    fn is_closed(&self) -> bool;
    /// Whether it would serve one more stream now: the source asks before it opens a
    /// stream it would have to close at once.
    fn has_room(&self) -> bool;
}

/// An announced publisher: what the router is told, where its subscribers are
/// served, and where its recovery log is (when announced with one).
pub(crate) struct Announced {
    pub(crate) source: AnnouncedSource,
    pub(crate) acceptor: StreamAcceptor,
    pub(crate) recovery: Option<Arc<dyn RecoveryStreams>>,
}

/// What serves one data stream: the publisher's socket, or its recovery endpoint.
pub(crate) enum Serving {
    Publisher(StreamAcceptor),
    Recovery(Arc<dyn RecoveryStreams>),
}

impl Serving {
    pub(crate) fn is_closed(&self) -> bool {
        match self {
            Serving::Publisher(a) => a.is_closed(),
            Serving::Recovery(a) => a.is_closed(),
        }
    }

    /// Whether it would take one more connection (a recovery endpoint holds at most
    /// its connection bound; a publisher's socket decides when the stream arrives).
    pub(crate) fn has_room(&self) -> bool {
        match self {
            Serving::Publisher(_) => true,
            Serving::Recovery(a) => a.has_room(),
        }
    }

    pub(crate) fn accept(&self, stream: TunnelStream, label: String) -> bool {
        match self {
            Serving::Publisher(a) => a.accept_stream(stream, label),
            Serving::Recovery(a) => a.accept(stream),
        }
    }
}
