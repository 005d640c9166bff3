//! The router-event codec (each [`Dialect`]'s schema) and the event-plane sink.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::RouterEvent;
use super::dynamo::{decode_dynamo, encode_dynamo};
use super::processor::EventSink;
use super::schema::put_event_data;
use super::{EncodeError, KvDecodeError, SinkError};
use crate::BoxFuture;
use crate::msgpack::put;
use crate::publish::EventPublisher;
use crate::wire::Dialect;

/// Most events in one event-plane message.
///
/// ```
/// use eventplane::kv::{pipeline::{MAX_BLOCKS_PER_MESSAGE, MAX_EVENTS_PER_MESSAGE}};
/// assert_eq!((MAX_EVENTS_PER_MESSAGE, MAX_BLOCKS_PER_MESSAGE), (128, 8192));
/// ```
pub const MAX_EVENTS_PER_MESSAGE: usize = 128;
/// Most blocks in one event-plane message (a single larger event still goes alone).
///
/// ```
/// use eventplane::kv::{pipeline::{split_messages, MAX_BLOCKS_PER_MESSAGE, MAX_EVENTS_PER_MESSAGE}};
/// // The event-plane sink cuts its output with these bounds.
/// let messages = split_messages(&[], MAX_EVENTS_PER_MESSAGE, MAX_BLOCKS_PER_MESSAGE).count();
/// assert_eq!(messages, 0);
/// ```
pub const MAX_BLOCKS_PER_MESSAGE: usize = 8192;

/// Splits `events` into consecutive runs of at most `max_events` events and
/// `max_blocks` blocks; every run has at least one event, so one event over the block
/// limit travels alone (and a `max_events` of 0 is taken as 1).
///
/// ```
/// use eventplane::kv::{KvEvent, KvEventData, RouterEvent, StorageTier, WorkerId, pipeline::split_messages};
/// let ev = RouterEvent { worker_id: WorkerId(1), tier: StorageTier::Device,
///     event: KvEvent { id: 1, dp_rank: 0, data: KvEventData::Cleared } };
/// let events = vec![ev; 300];
/// let sizes: Vec<usize> = split_messages(&events, 128, 8192).map(|m| m.len()).collect();
/// assert_eq!(sizes, vec![128, 128, 44]);
/// ```
pub fn split_messages(
    events: &[RouterEvent],
    max_events: usize,
    max_blocks: usize,
) -> impl Iterator<Item = &[RouterEvent]> {
    let max_events = max_events.max(1);
    let mut rest = events;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut n = 0;
        let mut blocks = 0;
        for ev in rest.iter().take(max_events) {
            let b = ev.event.data.block_count();
            if n > 0 && blocks + b > max_blocks {
                break;
            }
            n += 1;
            blocks += b;
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Some(head)
    })
}

/// The router-event codec: how each dialect's publishers carry [`RouterEvent`]s.
impl Dialect {
    /// Encodes router events as the payload of one message in this dialect: msgpack
    /// lists of `{worker_id, tier, event: {id, dp_rank, data}}` (ours) or of Dynamo's
    /// `{worker_id, storage_tier, residency_domain, event: {event_id, data, dp_rank}}`,
    /// byte for byte what a Dynamo 1.6.1 worker writes for the same events. `data` is
    /// `{"stored": {parent_hash, blocks: [{block_hash, tokens_hash}]}}`,
    /// `{"removed": {block_hashes}}` or `"cleared"` in both (Dynamo's adds
    /// `start_position` and `mm_extra_info`, written `nil`).
    ///
    /// ```
    /// use eventplane::kv::{KvEvent, KvEventData, RouterEvent, StorageTier, WorkerId};
    /// use eventplane::wire::Dialect;
    /// let events = vec![RouterEvent {
    ///     worker_id: WorkerId(77),
    ///     tier: StorageTier::HostPinned,
    ///     event: KvEvent { id: 7, dp_rank: 0, data: KvEventData::Cleared },
    /// }];
    /// for dialect in [Dialect::EventPlane, Dialect::Dynamo] {
    ///     let payload = dialect.encode_router_events(&events)?;
    ///     assert!(payload.windows(11).any(|w| w == b"host_pinned"));
    ///     assert_eq!(dialect.decode_router_events(&payload)?, events);
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn encode_router_events(&self, events: &[RouterEvent]) -> Result<Vec<u8>, EncodeError> {
        match self {
            Dialect::EventPlane => encode_eventplane(events),
            Dialect::Dynamo => encode_dynamo(events),
        }
    }

    /// Decodes the router events of one message's payload in this dialect. Never
    /// panics on hostile input and never reserves for more elements than the payload
    /// has bytes. Unknown fields are ignored (Dynamo adds fields between releases); an
    /// unknown event kind fails the payload. In Dynamo's dialect a storage tier this
    /// version does not know decodes as
    /// [`StorageTier::External`](crate::kv::StorageTier::External); in ours it fails
    /// the payload (both ends are this crate, so a new tier means a new version).
    ///
    /// ```
    /// use eventplane::wire::Dialect;
    /// // One event as a later Dynamo might write it: an extra field, no dp_rank.
    /// let payload = b"\x91\x84\xa9worker_id\x01\xacstorage_tier\xa6device\xa3new\xc0\xa5event\x82\xa8event_id\x05\xa4data\xa7cleared";
    /// let events = Dialect::Dynamo.decode_router_events(payload)?;
    /// assert_eq!((events[0].worker_id.0, events[0].event.id, events[0].event.dp_rank), (1, 5, 0));
    /// for dialect in [Dialect::EventPlane, Dialect::Dynamo] {
    ///     assert!(dialect.decode_router_events(b"\xdd\xff\xff\xff\xff").is_err()); // forged length
    /// }
    /// # Ok::<(), eventplane::kv::KvDecodeError>(())
    /// ```
    pub fn decode_router_events(&self, payload: &[u8]) -> Result<Vec<RouterEvent>, KvDecodeError> {
        match self {
            Dialect::EventPlane => decode_eventplane(payload),
            Dialect::Dynamo => decode_dynamo(payload),
        }
    }
}

/// Encodes router events in our schema: msgpack with named fields.
pub(super) fn encode_eventplane(events: &[RouterEvent]) -> Result<Vec<u8>, EncodeError> {
    let err = |e| EncodeError::new("router events", e);
    // Written field by field, exactly as serde's derive of `RouterEvent` with named
    // fields writes it (a test compares them).
    let mut out = Vec::with_capacity(events.len().saturating_mul(96));
    put::array_len(&mut out, events.len()).map_err(err)?;
    for e in events {
        out.extend_from_slice(b"\x83\xa9worker_id");
        put::uint(&mut out, e.worker_id.0);
        out.extend_from_slice(b"\xa4tier");
        // Our tier names are Dynamo's (serde's snake case of `StorageTier`).
        put::str(&mut out, super::dynamo::tier_name(e.tier));
        out.extend_from_slice(b"\xa5event\x83\xa2id");
        put::uint(&mut out, e.event.id);
        out.extend_from_slice(b"\xa7dp_rank");
        put::uint(&mut out, u64::from(e.event.dp_rank));
        out.extend_from_slice(b"\xa4data");
        put_event_data(&mut out, &e.event.data, Dialect::EventPlane).map_err(err)?;
    }
    Ok(out)
}

/// Decodes a payload in our schema back into router events.
pub(super) fn decode_eventplane(payload: &[u8]) -> Result<Vec<RouterEvent>, KvDecodeError> {
    KvDecodeError::check_shape(payload)?;
    rmp_serde::from_slice(payload).map_err(|e| KvDecodeError(Box::new(e)))
}

/// Publishes router events on the event plane through an [`EventPublisher`]: split
/// into messages of at most 128 events and 8192 blocks, msgpack with named fields, in
/// the schema of the publisher's [`Dialect`] (ours, or Dynamo's).
/// Never blocks; subscribers that fall behind lose messages at the publisher, counted
/// there (and seen by them as sequence gaps).
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::kv::{KvEvent, KvEventData, RouterEvent, StorageTier, WorkerId, pipeline::{EventPlaneSink, EventSink}};
/// use eventplane::publish::EventPublisher;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let publisher = EventPublisher::builder(Arc::new(MemoryDiscovery::new()), "prod", "worker", "kv-events")
///     .build()
///     .await?;
/// let sink = EventPlaneSink::new(Arc::new(publisher));
/// let ev = RouterEvent {
///     worker_id: WorkerId(1),
///     tier: StorageTier::Device,
///     event: KvEvent { id: 1, dp_rank: 0, data: KvEventData::Cleared },
/// };
/// sink.publish(&vec![ev; 300]).await?;
/// assert_eq!(sink.messages(), 3); // at most 128 events per message
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct EventPlaneSink {
    publisher: Arc<EventPublisher>,
    messages: AtomicU64,
}

impl EventPlaneSink {
    /// A sink publishing through `publisher`.
    pub fn new(publisher: Arc<EventPublisher>) -> EventPlaneSink {
        EventPlaneSink {
            publisher,
            messages: AtomicU64::new(0),
        }
    }

    /// Messages published so far.
    pub fn messages(&self) -> u64 {
        self.messages.load(Ordering::Relaxed)
    }

    /// The publisher.
    pub fn publisher(&self) -> &Arc<EventPublisher> {
        &self.publisher
    }

    /// The publisher back (for [`EventPublisher::shutdown`] once no one else holds it).
    pub fn into_publisher(self) -> Arc<EventPublisher> {
        self.publisher
    }
}

impl EventSink for EventPlaneSink {
    fn publish<'a>(&'a self, events: &'a [RouterEvent]) -> BoxFuture<'a, Result<(), SinkError>> {
        let result = (|| {
            for message in split_messages(events, MAX_EVENTS_PER_MESSAGE, MAX_BLOCKS_PER_MESSAGE) {
                let payload = self
                    .publisher
                    .dialect()
                    .encode_router_events(message)
                    .map_err(|e| SinkError(Box::new(e)))?;
                self.publisher.publish(payload);
                self.messages.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })();
        Box::pin(async move { result })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_events_are_written_as_serde_writes_them() {
        let events = crate::kv::tests::every_tier_and_kind();
        let ours = encode_eventplane(&events).unwrap();
        assert_eq!(ours, rmp_serde::to_vec_named(&events).unwrap());
        assert_eq!(decode_eventplane(&ours).unwrap(), events);
    }
}
