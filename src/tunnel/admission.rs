//! The bus's pool of connections that have not authenticated yet (DESIGN §7.3): small,
//! capped per source, and full means the newest stays and an old one goes, the least
//! advanced first (silent, then speaking, then past TLS), so a flood of idle
//! connections cannot keep a broker out.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;

/// What admitting a new unauthenticated connection did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Admit<T> {
    /// Taken; the pool had room.
    Admitted,
    /// Taken; to make room, this older connection must go.
    Evicted(T),
    /// Refused: its source address already holds its share of the pool.
    Refused,
}

/// How far an unauthenticated connection got: the least advanced goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Progress {
    /// Nothing received yet.
    Silent,
    /// It sent its first bytes (a TLS client hello, for a broker).
    Spoke,
    /// Its TLS handshake completed.
    Tls,
}

/// One unauthenticated connection.
#[derive(Debug)]
struct Entry<T> {
    id: u64,
    source: IpAddr,
    progress: Progress,
    handle: T,
}

/// Unauthenticated connections, oldest first, with a count per source address.
#[derive(Debug)]
pub(crate) struct Pending<T> {
    max: usize,
    max_per_source: usize,
    conns: VecDeque<Entry<T>>,
    per_source: HashMap<IpAddr, usize>,
}

impl<T> Pending<T> {
    pub(crate) fn new(max: usize, max_per_source: usize) -> Pending<T> {
        Pending {
            max: max.max(1),
            max_per_source: max_per_source.max(1),
            conns: VecDeque::new(),
            per_source: HashMap::new(),
        }
    }

    /// Admits connection `id` from `source`. When the pool is full, one goes: among
    /// the least advanced connections (silent before speaking before past TLS), the
    /// oldest of the source holding the most. A flood of idle connections evicts
    /// itself before a broker that is handshaking; one that completes TLS handshakes
    /// competes with brokers doing the same, oldest first.
    #[cfg(test)]
    pub(crate) fn admit(&mut self, id: u64, source: IpAddr, handle: T) -> Admit<T> {
        self.admit_at(id, source, Progress::Silent, handle)
    }

    /// [`admit`](Self::admit) a connection already as far as `progress` (its first
    /// bytes were waiting when it was accepted).
    pub(crate) fn admit_at(
        &mut self,
        id: u64,
        source: IpAddr,
        progress: Progress,
        handle: T,
    ) -> Admit<T> {
        if self.per_source.get(&source).copied().unwrap_or(0) >= self.max_per_source {
            return Admit::Refused;
        }
        let mut evicted = None;
        if self.conns.len() >= self.max {
            let least = self
                .conns
                .iter()
                .map(|e| e.progress)
                .min()
                .unwrap_or(Progress::Silent);
            let candidate = |e: &Entry<T>| e.progress == least;
            let count = |e: &Entry<T>| self.per_source.get(&e.source).copied().unwrap_or(0);
            let most = self
                .conns
                .iter()
                .filter(|e| candidate(e))
                .map(count)
                .max()
                .unwrap_or(0);
            let at = self
                .conns
                .iter()
                .position(|e| candidate(e) && count(e) == most)
                .unwrap_or(0);
            if let Some(old) = self.conns.remove(at) {
                self.forget_source(old.source);
                evicted = Some(old.handle);
            }
        }
        self.conns.push_back(Entry {
            id,
            source,
            progress,
            handle,
        });
        *self.per_source.entry(source).or_default() += 1;
        match evicted {
            Some(old) => Admit::Evicted(old),
            None => Admit::Admitted,
        }
    }

    /// Connection `id` got as far as `progress`: it is evicted only after every less
    /// advanced one.
    pub(crate) fn progressed(&mut self, id: u64, progress: Progress) {
        if let Some(entry) = self.conns.iter_mut().find(|e| e.id == id) {
            entry.progress = entry.progress.max(progress);
        }
    }

    /// Connection `id` authenticated or closed: it leaves the pool (if still in it).
    pub(crate) fn remove(&mut self, id: u64) -> bool {
        let Some(at) = self.conns.iter().position(|e| e.id == id) else {
            return false;
        };
        if let Some(old) = self.conns.remove(at) {
            self.forget_source(old.source);
        }
        true
    }

    fn forget_source(&mut self, ip: IpAddr) {
        if let Some(n) = self.per_source.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.per_source.remove(&ip);
            }
        }
    }

    /// Connections in the pool now.
    pub(crate) fn len(&self) -> usize {
        self.conns.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 1, 0, last])
    }

    #[test]
    fn a_source_gets_its_share_and_no_more() {
        let mut pool = Pending::new(64, 2);
        assert_eq!(pool.admit(1, ip(1), 1), Admit::Admitted);
        assert_eq!(pool.admit(2, ip(1), 2), Admit::Admitted);
        assert_eq!(pool.admit(3, ip(1), 3), Admit::Refused);
        assert_eq!(pool.admit(4, ip(2), 4), Admit::Admitted);
        assert!(pool.remove(1));
        assert!(!pool.remove(1));
        assert_eq!(pool.admit(5, ip(1), 5), Admit::Admitted);
        assert_eq!(pool.len(), 3);
    }

    #[test]
    fn full_evicts_the_oldest_of_the_heaviest_source() {
        let mut pool = Pending::new(4, 8);
        // A broker connects once, then a flood from one address fills the pool.
        assert_eq!(pool.admit(1, ip(9), "broker"), Admit::Admitted);
        for id in 2..=4 {
            assert_eq!(pool.admit(id, ip(1), "flood"), Admit::Admitted);
        }
        // The flood goes on: it evicts itself, oldest first, never the broker.
        for id in 5..100 {
            assert_eq!(pool.admit(id, ip(1), "flood"), Admit::Evicted("flood"));
        }
        assert!(pool.remove(1), "the broker is still pending");
        // Every source holding one each: the oldest of all goes.
        let mut pool = Pending::new(2, 8);
        pool.admit(1, ip(1), 1);
        pool.admit(2, ip(2), 2);
        assert_eq!(pool.admit(3, ip(3), 3), Admit::Evicted(1));
        assert_eq!(pool.len(), 2);
    }

    #[test]
    fn a_connection_that_spoke_outlives_every_silent_one() {
        let mut pool = Pending::new(4, 8);
        pool.admit(1, ip(9), "broker");
        pool.progressed(1, Progress::Spoke);
        // One idle connection per address, more addresses than the pool holds.
        for id in 2..1000 {
            let admitted = pool.admit(id, ip((id % 250) as u8), "flood");
            assert!(matches!(
                admitted,
                Admit::Admitted | Admit::Evicted("flood")
            ));
        }
        assert!(pool.remove(1), "the speaking broker is still pending");
        assert!(!pool.remove(1), "removed once");
        pool.admit(1, ip(9), "broker");
        // Past TLS outlives speaking: a flood that says one byte evicts itself.
        pool.progressed(1, Progress::Tls);
        for id in 1000..2000 {
            let admitted = pool.admit(id, ip((id % 250) as u8), "flood");
            pool.progressed(id, Progress::Spoke);
            assert!(matches!(
                admitted,
                Admit::Admitted | Admit::Evicted("flood")
            ));
        }
        assert!(pool.remove(1), "the broker past TLS is still pending");
        // When every one is as far, the oldest of the busiest source goes.
        let mut pool = Pending::new(2, 8);
        for id in 1..=2 {
            pool.admit(id, ip(1), id);
            pool.progressed(id, Progress::Spoke);
        }
        assert_eq!(pool.admit(3, ip(2), 3), Admit::Evicted(1));
    }
}
