use std::sync::Arc;

use eventplane::ConfigError;
use eventplane::discovery::{Discovery, Query, WorkerIdentity};
use eventplane::kv::{
    BlockHash,
    router::{Attribution, IndexFeed, RouterIndexConfig},
};
use eventplane::subscriber::{DynamicSubscriber, Item, Notice};
use eventplane::wire::Dialect;

/// Follows every KV-event publisher of `namespace` (each worker registers one).
pub fn subscribe(
    discovery: Arc<dyn Discovery>,
    namespace: &str,
) -> Result<DynamicSubscriber, ConfigError> {
    DynamicSubscriber::builder(discovery, Query::new(namespace))
        .topic("kv-events")
        // Connections and departures, next to the messages. A full queue drops
        // notices (`stats().notices_dropped`): size it for the publishers you follow.
        .notices(4096)
        .expect_worker_identity(true) // warns about a worker that registered none
        .spawn()
}

/// Which blocks each worker holds, kept honest by the library's `IndexFeed`: events
/// count only under the identity their publisher registered, an event id that is not
/// the publisher's next one (events lost on the way) drops what it fed before
/// anything more is applied, and a departed publisher takes its blocks with it.
#[derive(Debug)]
pub struct Index {
    /// The index, and how it was fed (`feed.stats()`: refusals, wipes, undecodable
    /// payloads).
    pub feed: IndexFeed,
    /// Deliveries handled.
    pub deliveries: u64,
    /// Connections to publishers so far (reconnections included).
    pub connections: u64,
}

impl Default for Index {
    fn default() -> Index {
        // Strict: a publisher that registered no worker identity is not indexed
        // (counted in `feed.stats().index.refused_unidentified`).
        let config = RouterIndexConfig::default().attribution(Attribution::Strict);
        Index {
            feed: IndexFeed::new(config),
            deliveries: 0,
            connections: 0,
        }
    }
}

impl Index {
    /// The workers holding `block`.
    pub fn holders(&self, block: u64) -> impl Iterator<Item = WorkerIdentity> + '_ {
        let index = self.feed.index();
        index
            .ranks()
            .filter(move |&(w, r)| index.holds(w, r, BlockHash(block)))
            .map(|(w, r)| WorkerIdentity::new(w.0, r))
    }

    /// Events refused because their publisher registered no worker identity.
    pub fn unidentified(&self) -> u64 {
        self.feed.stats().index.refused_unidentified
    }

    /// Deliveries whose payload did not decode.
    pub fn undecodable(&self) -> u64 {
        self.feed.stats().undecodable
    }

    /// Times a publisher's blocks were dropped because some of its events were lost.
    pub fn lost(&self) -> u64 {
        let s = self.feed.stats();
        s.wipes_id_gap + s.wipes_reconnect
    }
}

/// Feeds `index` from `router` until `done(index)` holds or the router stops.
pub async fn route(
    router: &mut DynamicSubscriber,
    index: &mut Index,
    done: impl Fn(&Index) -> bool,
) {
    while !done(index) {
        // Deliveries and notices in one ordered stream: a publisher's `Departed`
        // comes after its last delivery.
        let Some(item) = router.recv_item().await else {
            return; // shut down
        };
        match &item {
            Item::Delivery(_) => index.deliveries += 1,
            Item::Notice(Notice::Connected(_)) => index.connections += 1,
            _ => {}
        }
        // An undecodable payload is counted in the feed's stats.
        let _ = index.feed.item(Dialect::EventPlane, &item);
    }
}
