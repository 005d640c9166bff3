//! The bus's pool of connections that have not authenticated yet (DESIGN §7.3): small,
//! capped per source, and full means the newest stays and another goes: from the
//! source holding the most (or the newcomer's own source, at its share), one past TLS
//! that sent no request within [`STALLED_AFTER_TLS`], else the least advanced
//! (silent, then speaking, then past TLS), the oldest first. A broker sends its request
//! right after its handshake, so a flood that finishes TLS and idles goes before it,
//! and a flood of idle connections evicts itself before a broker that is handshaking.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// How long a connection past TLS may go without a request before it is the first to
/// go (a broker sends its session request at once).
pub(crate) const STALLED_AFTER_TLS: Duration = Duration::from_millis(250);

/// What admitting a new unauthenticated connection did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Admit<T> {
    /// Taken; the pool had room.
    Admitted,
    /// Taken; to make room, this other connection must go.
    Evicted(T),
}

/// How far an unauthenticated connection got; each step is progress.
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
    /// When it was accepted or last progressed.
    since: Instant,
    handle: T,
}

impl<T> Entry<T> {
    /// Its place in the eviction order at `now`, first to go first: stalled past TLS,
    /// then the least advanced, the longest at its step.
    fn rank(&self, now: Instant) -> (bool, Progress, Instant) {
        let stalled = self.progress == Progress::Tls
            && now.saturating_duration_since(self.since) >= STALLED_AFTER_TLS;
        (!stalled, self.progress, self.since)
    }
}

/// Unauthenticated connections, with a count per source address.
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

    /// Admits connection `id` from `source`, already as far as `progress` at `now`
    /// (its first bytes may be waiting when it is accepted). When its source holds its
    /// share, one of that source's goes; when the pool is full, one of the source
    /// holding the most: the first by [`Entry::rank`].
    pub(crate) fn admit_at(
        &mut self,
        id: u64,
        source: IpAddr,
        progress: Progress,
        now: Instant,
        handle: T,
    ) -> Admit<T> {
        let count = |per_source: &HashMap<IpAddr, usize>, ip: &IpAddr| {
            per_source.get(ip).copied().unwrap_or(0)
        };
        let victim = if count(&self.per_source, &source) >= self.max_per_source {
            self.conns
                .iter()
                .enumerate()
                .filter(|(_, e)| e.source == source)
                .min_by_key(|(_, e)| e.rank(now))
                .map(|(at, _)| at)
        } else if self.conns.len() >= self.max {
            let most = self
                .conns
                .iter()
                .map(|e| count(&self.per_source, &e.source))
                .max()
                .unwrap_or(0);
            self.conns
                .iter()
                .enumerate()
                .filter(|(_, e)| count(&self.per_source, &e.source) == most)
                .min_by_key(|(_, e)| e.rank(now))
                .map(|(at, _)| at)
        } else {
            None
        };
        let evicted = victim.and_then(|at| self.conns.remove(at)).map(|old| {
            self.forget_source(old.source);
            old.handle
        });
        self.conns.push_back(Entry {
            id,
            source,
            progress,
            since: now,
            handle,
        });
        *self.per_source.entry(source).or_default() += 1;
        match evicted {
            Some(old) => Admit::Evicted(old),
            None => Admit::Admitted,
        }
    }

    /// Connection `id` got as far as `progress` at `now` (a step further).
    pub(crate) fn progressed(&mut self, id: u64, progress: Progress, now: Instant) {
        if let Some(entry) = self.conns.iter_mut().find(|e| e.id == id)
            && progress > entry.progress
        {
            entry.progress = progress;
            entry.since = now;
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
    use std::time::Duration;

    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 1, 0, last])
    }

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn a_source_at_its_share_loses_one_of_its_own_never_another_s() {
        let t0 = Instant::now();
        let mut pool = Pending::new(64, 2);
        assert_eq!(
            pool.admit_at(1, ip(1), Progress::Silent, at(t0, 0), 1),
            Admit::Admitted
        );
        assert_eq!(
            pool.admit_at(2, ip(1), Progress::Silent, at(t0, 1), 2),
            Admit::Admitted
        );
        assert_eq!(
            pool.admit_at(4, ip(2), Progress::Silent, at(t0, 2), 4),
            Admit::Admitted
        );
        // 1 spoke: 2 is the less advanced.
        pool.progressed(1, Progress::Spoke, at(t0, 3));
        assert_eq!(
            pool.admit_at(3, ip(1), Progress::Silent, at(t0, 4), 3),
            Admit::Evicted(2)
        );
        assert!(pool.remove(1));
        assert!(!pool.remove(1));
        assert_eq!(
            pool.admit_at(5, ip(1), Progress::Silent, at(t0, 5), 5),
            Admit::Admitted
        );
        assert_eq!(pool.len(), 3);
    }

    #[test]
    fn full_evicts_the_least_advanced_oldest_of_the_heaviest_source() {
        let t0 = Instant::now();
        let mut pool = Pending::new(4, 8);
        // A broker connects once, then a flood from one address fills the pool.
        pool.admit_at(1, ip(9), Progress::Silent, t0, "broker");
        for id in 2..=4 {
            let admitted = pool.admit_at(id, ip(1), Progress::Tls, at(t0, id), "flood");
            assert_eq!(admitted, Admit::Admitted);
        }
        // The flood goes on: it evicts itself, never the broker.
        for id in 5..100 {
            let admitted = pool.admit_at(id, ip(1), Progress::Tls, at(t0, id), "flood");
            assert_eq!(admitted, Admit::Evicted("flood"));
        }
        assert!(pool.remove(1), "the broker is still pending");
        // Every source holding one each: the least advanced goes, the oldest first.
        let mut pool = Pending::new(3, 8);
        pool.admit_at(1, ip(1), Progress::Spoke, t0, 1);
        pool.admit_at(2, ip(2), Progress::Silent, at(t0, 1), 2);
        pool.admit_at(3, ip(3), Progress::Silent, at(t0, 2), 3);
        assert_eq!(
            pool.admit_at(4, ip(4), Progress::Spoke, at(t0, 3), 4),
            Admit::Evicted(2)
        );
        assert_eq!(
            pool.admit_at(5, ip(5), Progress::Spoke, at(t0, 4), 5),
            Admit::Evicted(3)
        );
        assert_eq!(
            pool.admit_at(6, ip(6), Progress::Spoke, at(t0, 5), 6),
            Admit::Evicted(1)
        );
    }

    /// One connection an address, more than the pool holds: a connection past TLS
    /// outlives those still handshaking only while it is about to send its request
    /// (issue 49 M5: idle past TLS, a flood outranked every broker in its handshake).
    #[test]
    fn past_tls_without_a_request_goes_first() {
        let t0 = Instant::now();
        let mut pool = Pending::new(8, 8);
        for id in 100..108 {
            pool.admit_at(id, ip(id as u8), Progress::Tls, t0, "flood");
        }
        // Past TLS 250 ms ago with no request: they go before a broker handshaking.
        let later = t0 + STALLED_AFTER_TLS;
        pool.admit_at(1, ip(9), Progress::Spoke, later, "broker");
        for id in 200..207 {
            let admitted = pool.admit_at(id, ip(id as u8), Progress::Spoke, later, "flood");
            assert_eq!(admitted, Admit::Evicted("flood"));
        }
        assert!(pool.remove(1), "the broker is still pending");
        // Within 250 ms of its handshake, past TLS still outranks handshaking.
        let mut pool = Pending::new(2, 8);
        pool.admit_at(1, ip(1), Progress::Spoke, t0, 1);
        pool.progressed(1, Progress::Tls, at(t0, 1));
        pool.admit_at(2, ip(2), Progress::Spoke, at(t0, 2), 2);
        assert_eq!(
            pool.admit_at(3, ip(3), Progress::Spoke, at(t0, 200), 3),
            Admit::Evicted(2)
        );
        // A step already taken is no progress: its clock keeps running.
        pool.progressed(1, Progress::Spoke, at(t0, 250));
        assert_eq!(
            pool.admit_at(4, ip(4), Progress::Spoke, at(t0, 251), 4),
            Admit::Evicted(1)
        );
    }
}
