//! Which broker carries which publisher (DESIGN §7.3): rendezvous (highest random
//! weight) hashing of (broker client id, publisher id). Deterministic across
//! processes, so every router replica picks the same owner; a broker joining or
//! leaving moves only the publishers it wins or held.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The weight of `broker` for `publisher_id` (the highest weight owns it).
pub fn weight(broker: &str, publisher_id: u64) -> u64 {
    xxh3_64_with_seed(broker.as_bytes(), publisher_id)
}

/// The broker among `brokers` that owns `publisher_id`: the highest weight, ties
/// (astronomically rare) broken by the smaller client id. `None` when there is no
/// broker.
///
/// ```
/// use eventplane::tunnel::protocol::rendezvous_owner;
/// let brokers = ["broker-a", "broker-b", "broker-c"];
/// let owner = rendezvous_owner(brokers, 42).unwrap();
/// // Losing another broker never moves this publisher.
/// let one_less: Vec<&str> = brokers.into_iter().filter(|b| *b != owner).skip(1).chain([owner]).collect();
/// assert_eq!(rendezvous_owner(one_less, 42), Some(owner));
/// assert_eq!(rendezvous_owner(std::iter::empty::<&str>(), 42), None);
/// ```
pub fn rendezvous_owner<'a, I>(brokers: I, publisher_id: u64) -> Option<&'a str>
where
    I: IntoIterator<Item = &'a str>,
{
    brokers
        .into_iter()
        .map(|b| (weight(b, publisher_id), std::cmp::Reverse(b), b))
        .max()
        .map(|(_, _, b)| b)
}

/// `brokers` in rendezvous order for `publisher_id`: the owner first, then the broker
/// that would own it if the owner left, and so on.
///
/// ```
/// use eventplane::tunnel::protocol::{rendezvous_owner, rendezvous_ranked};
/// let brokers = ["broker-a", "broker-b", "broker-c"];
/// let ranked = rendezvous_ranked(brokers, 42);
/// assert_eq!(ranked.first().copied(), rendezvous_owner(brokers, 42));
/// // The runner-up is the owner once the first is gone.
/// let without_owner: Vec<&str> = brokers.into_iter().filter(|b| *b != ranked[0]).collect();
/// assert_eq!(rendezvous_owner(without_owner, 42), Some(ranked[1]));
/// ```
pub fn rendezvous_ranked<'a, I>(brokers: I, publisher_id: u64) -> Vec<&'a str>
where
    I: IntoIterator<Item = &'a str>,
{
    let mut ranked: Vec<(u64, std::cmp::Reverse<&str>, &str)> = brokers
        .into_iter()
        .map(|b| (weight(b, publisher_id), std::cmp::Reverse(b), b))
        .collect();
    ranked.sort_unstable_by(|x, y| y.cmp(x));
    ranked.into_iter().map(|(_, _, b)| b).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn publishers_spread_and_a_lost_broker_moves_only_its_share() {
        let three = ["a", "b", "c"];
        let owners: Vec<&str> = (0..3000)
            .map(|p| rendezvous_owner(three, p).unwrap())
            .collect();
        for b in three {
            let share = owners.iter().filter(|o| **o == b).count();
            assert!((800..1200).contains(&share), "{b}: {share} of 3000");
        }
        // "b" leaves: only its publishers move, and they spread over the other two.
        let two = ["a", "c"];
        let mut moved = 0;
        for (p, before) in owners.iter().enumerate() {
            let after = rendezvous_owner(two, p as u64).unwrap();
            if *before == "b" {
                moved += 1;
            } else {
                assert_eq!(after, *before, "publisher {p} moved without cause");
            }
        }
        assert!(moved > 800);
    }

    #[test]
    fn the_owner_does_not_depend_on_order_or_process() {
        // Fixed values: every router replica, on any machine, computes the same.
        assert_eq!(weight("broker-a", 7), xxh3_64_with_seed(b"broker-a", 7));
        for p in 0..100 {
            assert_eq!(
                rendezvous_owner(["x", "y", "z"], p),
                rendezvous_owner(["z", "x", "y"], p)
            );
        }
    }
}
