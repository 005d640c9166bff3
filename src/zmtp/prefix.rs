//! Prefix matching that stays fast with thousands of subscriptions.
//!
//! Prefixes live in a hash map keyed by the prefix bytes, plus a sorted list of the
//! distinct prefix lengths in use. Matching a topic costs one hash look-up per distinct
//! length no longer than the topic — independent of how many prefixes (or subscribers)
//! there are. Subscription prefixes are short and few distinct lengths occur, so this
//! beats a byte trie both in look-ups and in memory. The empty prefix ("everything",
//! the most common subscription) has a slot of its own: it matches without a look-up.
//! Up to eight prefixes (a subscriber's usual case) are compared one by one instead,
//! which costs less than hashing the topic.

use std::collections::HashMap;

use bytes::Bytes;

#[derive(Debug, Clone)]
pub(crate) struct PrefixMap<V> {
    /// The value of the empty prefix. Kept out of `map`: an empty `Bytes` points at a
    /// dangling address, and comparing keys with it costs a microcode assist on every
    /// look-up with some `memcmp` implementations.
    empty: Option<(Bytes, V)>,
    map: HashMap<Bytes, V>,
    /// `(length, number of prefixes of that length)`, sorted by length.
    lens: Vec<(usize, usize)>,
}

/// Up to this many prefixes (a subscriber's usual one or two) are matched by comparing
/// each one, which costs less than hashing the topic.
const FEW: usize = 8;

/// `prefix` is a prefix of `topic`, compared byte by byte: prefixes are short, and a
/// library `memcmp` call costs more than the comparison.
fn starts_with(topic: &[u8], prefix: &[u8]) -> bool {
    topic.len() >= prefix.len() && topic.iter().zip(prefix).all(|(a, b)| a == b)
}

impl<V> Default for PrefixMap<V> {
    fn default() -> Self {
        PrefixMap {
            empty: None,
            map: HashMap::new(),
            lens: Vec::new(),
        }
    }
}

impl<V> PrefixMap<V> {
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len() + usize::from(self.empty.is_some())
    }

    pub(crate) fn get_mut(&mut self, prefix: &[u8]) -> Option<&mut V> {
        if prefix.is_empty() {
            return self.empty.as_mut().map(|(_, v)| v);
        }
        self.map.get_mut(prefix)
    }

    /// The value for `prefix`, inserting `make()` when absent.
    pub(crate) fn entry(&mut self, prefix: &Bytes, make: impl FnOnce() -> V) -> &mut V {
        if prefix.is_empty() {
            let (_, v) = self.empty.get_or_insert_with(|| (Bytes::new(), make()));
            return v;
        }
        if !self.map.contains_key(&prefix[..]) {
            let len = prefix.len();
            match self.lens.binary_search_by_key(&len, |(l, _)| *l) {
                Ok(i) => {
                    if let Some((_, n)) = self.lens.get_mut(i) {
                        *n += 1;
                    }
                }
                Err(i) => self.lens.insert(i, (len, 1)),
            }
        }
        self.map.entry(prefix.clone()).or_insert_with(make)
    }

    pub(crate) fn remove(&mut self, prefix: &[u8]) -> Option<V> {
        if prefix.is_empty() {
            return self.empty.take().map(|(_, v)| v);
        }
        let v = self.map.remove(prefix)?;
        // A table that grew for thousands of prefixes and kept few would make the
        // direct comparison scan all its empty buckets.
        if self.map.capacity() > 4 * self.map.len().max(FEW) {
            self.map.shrink_to_fit();
        }
        if let Ok(i) = self.lens.binary_search_by_key(&prefix.len(), |(l, _)| *l) {
            if let Some((_, n)) = self.lens.get_mut(i) {
                *n -= 1;
                if *n == 0 {
                    self.lens.remove(i);
                }
            }
        }
        Some(v)
    }

    /// Calls `f` with the value of every stored prefix of `topic`.
    pub(crate) fn for_each_match(&self, topic: &[u8], mut f: impl FnMut(&V)) {
        if let Some((_, v)) = &self.empty {
            f(v);
        }
        if self.map.len() <= FEW {
            for (key, v) in &self.map {
                if starts_with(topic, key) {
                    f(v);
                }
            }
            return;
        }
        for (len, _) in &self.lens {
            let Some(head) = topic.get(..*len) else {
                break;
            };
            if let Some(v) = self.map.get(head) {
                f(v);
            }
        }
    }

    /// `true` when some stored prefix is a prefix of `topic`.
    pub(crate) fn matches(&self, topic: &[u8]) -> bool {
        if self.empty.is_some() {
            return true;
        }
        if self.map.len() <= FEW {
            return self.map.keys().any(|key| starts_with(topic, key));
        }
        self.lens.iter().any(|(len, _)| {
            topic
                .get(..*len)
                .is_some_and(|head| self.map.contains_key(head))
        })
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &Bytes> {
        self.empty.iter().map(|(k, _)| k).chain(self.map.keys())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_prefixes_only() {
        let mut m = PrefixMap::default();
        *m.entry(&Bytes::from_static(b"comp"), || 0) += 1;
        *m.entry(&Bytes::from_static(b"kv-"), || 0) += 1;
        assert!(m.matches(b"comp2"));
        assert!(m.matches(b"kv-events"));
        assert!(!m.matches(b"co"));
        assert!(!m.matches(b"kv"));
        let mut seen = 0;
        m.for_each_match(b"kv-x", |v| seen += v);
        assert_eq!(seen, 1);
        assert_eq!(m.remove(b"kv-"), Some(1));
        assert!(!m.matches(b"kv-events"));
        *m.entry(&Bytes::new(), || 0) += 1;
        assert!(m.matches(b""));
        assert!(m.matches(b"anything"));
        assert_eq!(m.len(), 2);
        let mut seen = 0;
        m.for_each_match(b"comp", |v| seen += v);
        assert_eq!(seen, 2);
        assert_eq!(m.keys().count(), 2);
        assert_eq!(m.remove(b""), Some(1));
        assert!(!m.matches(b"anything"));
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn few_and_many_prefixes_match_alike() {
        let mut m = PrefixMap::default();
        let key = |i: usize| Bytes::from(format!("p{i}/"));
        for i in 0..20 {
            *m.entry(&key(i), || 0) += 1;
            // Both the compared and the hashed form (past `FEW`) see every prefix.
            assert!(
                (0..=i).all(|j| m.matches(format!("p{j}/x").as_bytes())),
                "{i}"
            );
            assert!(!m.matches(b"p"));
            let mut seen = 0;
            m.for_each_match(b"p0/y", |v| seen += v);
            assert_eq!(seen, 1);
        }
        for i in (0..20).rev() {
            assert_eq!(m.remove(&key(i)), Some(1));
            assert!(!m.matches(format!("p{i}/x").as_bytes()));
            assert!(
                (0..i).all(|j| m.matches(format!("p{j}/x").as_bytes())),
                "{i}"
            );
        }
        assert_eq!(m.len(), 0);
    }
}
