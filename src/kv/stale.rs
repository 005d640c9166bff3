//! What a worker has told routers about its engine, and the clears that take it back
//! when the worker loses track of the engine (sans-IO).
//!
//! Routers index what the worker forwards. When batches are lost before the worker
//! (the engine's PUB dropped them, the connection ended, one could not be decoded) or
//! the engine restarted, the worker no longer knows what the engine holds, and neither can a router: every rank
//! the worker forwarded events for since its last clear gets a `Cleared`, so a router
//! holds nothing of that engine it could not prove (DESIGN §4.6).

use super::{DpRank, KvEventData, PlacementEvent};

/// Most data-parallel ranks a listener remembers between two clears of its engine
/// view. Events of further ranks are forwarded as usual but counted in
/// [`EngineListenerStats::untracked_ranks`](super::EngineListenerStats::untracked_ranks):
/// a lost view cannot be cleared for them. (An engine stream carries one rank, or a
/// few.)
pub(crate) const MAX_FORWARDED_RANKS: usize = 64;

/// Why the worker's view of its engine was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ViewLoss {
    /// The engine connection ended: what the engine sent until the next connection
    /// (a PUB keeps nothing for absent subscribers) is lost, and a restarted engine
    /// holds nothing of what the old one stored.
    Disconnected,
    /// The engine's batch sequence skipped this many batches (its PUB dropped them).
    Gap(u64),
    /// The engine's batch sequence started again or went back (a new engine).
    Reset,
    /// A batch was rejected whole, or a removal in it could not be decoded: blocks it
    /// removed may stay indexed.
    Undecodable,
    /// A loss the engine's replay buffer could not repair.
    Unrepaired(super::ReplayFallback),
}

impl ViewLoss {
    /// A key for rate-limited warnings.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ViewLoss::Disconnected => "disconnected",
            ViewLoss::Gap(_) => "gap",
            ViewLoss::Reset => "reset",
            ViewLoss::Undecodable => "undecodable",
            ViewLoss::Unrepaired(cause) => cause.as_str(),
        }
    }
}

/// The ranks forwarded to routers since their last clear.
#[derive(Debug, Default, Clone)]
pub(crate) struct Forwarded {
    /// At most [`MAX_FORWARDED_RANKS`], in the order first forwarded.
    ranks: Vec<DpRank>,
}

impl Forwarded {
    /// Notes events on their way to routers, in order: a rank's last event decides
    /// whether routers may hold blocks of it (anything but a `Cleared` may add some).
    /// Returns how many events were of a rank that could not be remembered.
    pub(crate) fn note(&mut self, events: &[PlacementEvent]) -> u64 {
        let mut untracked = 0;
        for ev in events {
            let rank = ev.placement.dp_rank;
            let at = self.ranks.iter().position(|&r| r == rank);
            match (&ev.event.data, at) {
                (KvEventData::Cleared, Some(i)) => {
                    self.ranks.swap_remove(i);
                }
                (KvEventData::Cleared, None) | (_, Some(_)) => {}
                (_, None) if self.ranks.len() < MAX_FORWARDED_RANKS => self.ranks.push(rank),
                (_, None) => untracked += 1,
            }
        }
        untracked
    }

    /// The ranks routers must now forget (sorted), forgotten here too: after their
    /// clears, routers hold nothing of this engine.
    pub(crate) fn take(&mut self) -> Vec<DpRank> {
        let mut ranks = std::mem::take(&mut self.ranks);
        ranks.sort_unstable();
        ranks
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{BlockHash, KvEvent, Placement, StorageTier, WorkerId};

    fn ev(dp_rank: DpRank, data: KvEventData) -> PlacementEvent {
        PlacementEvent {
            placement: Placement {
                worker_id: WorkerId(1),
                dp_rank,
                tier: StorageTier::Device,
            },
            event: KvEvent {
                id: 0,
                dp_rank,
                data,
            },
        }
    }

    fn removed(dp_rank: DpRank) -> PlacementEvent {
        ev(
            dp_rank,
            KvEventData::Removed {
                block_hashes: vec![BlockHash(1)],
            },
        )
    }

    #[test]
    fn a_ranks_last_event_decides() {
        let mut f = Forwarded::default();
        assert_eq!(f.note(&[removed(3), removed(0), removed(3)]), 0);
        // The engine's own clear of rank 3: routers hold nothing of it any more.
        f.note(&[ev(3, KvEventData::Cleared)]);
        assert_eq!(f.clone().take(), [0]);
        // A clear, then a store: rank 3 holds something again.
        f.note(&[ev(3, KvEventData::Cleared), removed(3)]);
        assert_eq!(f.take(), [0, 3]);
        // Taken: nothing left to clear until something is forwarded again.
        assert!(f.take().is_empty());
        f.note(&[ev(5, KvEventData::Cleared)]);
        assert!(f.take().is_empty());
    }

    #[test]
    fn ranks_past_the_cap_are_counted_not_remembered() {
        let mut f = Forwarded::default();
        let many: Vec<PlacementEvent> = (0..MAX_FORWARDED_RANKS as u32 + 2).map(removed).collect();
        assert_eq!(f.note(&many), 2);
        // Known ranks keep passing without counting.
        assert_eq!(f.note(&[removed(0)]), 0);
        assert_eq!(f.take().len(), MAX_FORWARDED_RANKS);
        // Once cleared, there is room again.
        assert_eq!(f.note(&[removed(1000)]), 0);
    }
}
