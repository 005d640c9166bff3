//! A consumer's view of a watch.

use std::collections::BTreeMap;

use crate::discovery::{ChannelId, DiscoveryEvent, Instance};

/// A consumer's view of a watch — what a correct consumer believes after each event:
/// id → (endpoint, incarnation). For tests of backends and of consumers.
///
/// ```
/// use eventplane::discovery::{ChannelId, DiscoveryEvent, Instance, Transport};
/// use eventplane::discovery::conformance::Mirror;
/// let id = ChannelId::new("ns", "c", "t", 7)?;
/// let mut mirror = Mirror::default();
/// mirror.apply(&DiscoveryEvent::Resync(vec![]));
/// mirror.apply(&DiscoveryEvent::Added(Instance::new(id.clone(), Transport::zmq("tcp://h:1"), 3)));
/// assert_eq!(mirror.publisher_ids(), vec![7]);
/// assert_eq!(mirror.state()[&id], ("tcp://h:1".to_owned(), 3));
/// mirror.apply(&DiscoveryEvent::Removed { id, incarnation: 3 });
/// assert!(mirror.state().is_empty());
/// assert_eq!(mirror.resyncs(), 1);
/// # Ok::<(), eventplane::discovery::DiscoveryError>(())
/// ```
#[derive(Debug, Default, Clone)]
pub struct Mirror {
    state: BTreeMap<ChannelId, (String, u64)>,
    resyncs: usize,
}

impl Mirror {
    /// What the consumer believes now: id → (endpoint, incarnation).
    pub fn state(&self) -> &BTreeMap<ChannelId, (String, u64)> {
        &self.state
    }

    /// `Resync`s applied so far (the initial sync's included).
    pub fn resyncs(&self) -> usize {
        self.resyncs
    }

    /// The publisher ids believed live, in id order.
    pub fn publisher_ids(&self) -> Vec<u64> {
        self.state.keys().map(ChannelId::publisher_id).collect()
    }

    /// Applies one event, as a consumer must.
    pub fn apply(&mut self, ev: &DiscoveryEvent) {
        match ev {
            DiscoveryEvent::Added(i) => {
                self.state.insert(
                    i.id.clone(),
                    (i.transport.endpoint().to_owned(), i.incarnation),
                );
            }
            DiscoveryEvent::Removed { id, .. } => {
                self.state.remove(id);
            }
            DiscoveryEvent::Resync(all) => {
                self.resyncs += 1;
                self.state = view(all);
            }
        }
    }
}

pub(super) fn view(instances: &[Instance]) -> BTreeMap<ChannelId, (String, u64)> {
    instances
        .iter()
        .map(|i| {
            (
                i.id.clone(),
                (i.transport.endpoint().to_owned(), i.incarnation),
            )
        })
        .collect()
}

/// `view`, with incarnations dropped unless `settings` asks for exact ones.
pub(super) fn view_as(
    settings: &super::Settings,
    instances: &[Instance],
) -> BTreeMap<ChannelId, (String, u64)> {
    normalized(settings, view(instances))
}

/// A view with incarnations dropped unless `settings` asks for exact ones.
pub(super) fn normalized(
    settings: &super::Settings,
    mut state: BTreeMap<ChannelId, (String, u64)>,
) -> BTreeMap<ChannelId, (String, u64)> {
    if !settings.exact_incarnations {
        for v in state.values_mut() {
            v.1 = 0;
        }
    }
    state
}
