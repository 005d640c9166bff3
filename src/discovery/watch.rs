//! The stale-removal filter of rule 5 of the watch contract (the bounded backlog of
//! rule 4 is `backlog`).

use std::collections::HashMap;

use super::{ChannelId, DiscoveryEvent};

/// Drops removals that are older than the registration a watcher last saw (rule 5 of
/// the watch contract), and removals of ids the watcher never saw.
///
/// Backends run every event through one of these per watch; consumers can use it on
/// any stream too.
///
/// ```
/// use eventplane::discovery::{ChannelId, DiscoveryEvent, Instance, StaleFilter, Transport};
/// let id = ChannelId::new("ns", "c", "t", 1)?;
/// let mut filter = StaleFilter::default();
/// let v2 = Instance::new(id.clone(), Transport::zmq("tcp://127.0.0.1:1"), 2);
/// assert!(filter.admit(&DiscoveryEvent::Added(v2)));
/// // A late removal of incarnation 1 must not remove incarnation 2.
/// assert!(!filter.admit(&DiscoveryEvent::Removed { id: id.clone(), incarnation: 1 }));
/// assert!(filter.admit(&DiscoveryEvent::Removed { id, incarnation: 2 }));
/// # Ok::<(), eventplane::discovery::DiscoveryError>(())
/// ```
#[derive(Debug, Default, Clone)]
pub struct StaleFilter {
    known: HashMap<ChannelId, u64>,
}

impl StaleFilter {
    /// Whether `event` should be delivered; updates the filter's view.
    pub fn admit(&mut self, event: &DiscoveryEvent) -> bool {
        match event {
            DiscoveryEvent::Added(instance) => {
                match self.known.get(&instance.id) {
                    Some(&seen) if seen > instance.incarnation => return false,
                    _ => {}
                }
                self.known.insert(instance.id.clone(), instance.incarnation);
                true
            }
            DiscoveryEvent::Removed { id, incarnation } => match self.known.get(id) {
                Some(&seen) if seen <= *incarnation => {
                    self.known.remove(id);
                    true
                }
                _ => false,
            },
            DiscoveryEvent::Resync(all) => {
                self.known = all.iter().map(|i| (i.id.clone(), i.incarnation)).collect();
                true
            }
        }
    }
}
