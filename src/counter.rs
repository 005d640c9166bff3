//! Saturating counters shared by every component's stats.

use std::sync::atomic::{AtomicU64, Ordering};

/// Adds `n` to `counter`, saturating at `u64::MAX` instead of wrapping (a forged
/// sequence jump or byte count must not turn a counter into nonsense).
pub(crate) fn add(counter: &AtomicU64, n: u64) {
    if n > 0 {
        // The closure always returns `Some`, so the update cannot fail.
        let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some(v.saturating_add(n))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saturates() {
        let c = AtomicU64::new(u64::MAX - 1);
        add(&c, 5);
        assert_eq!(c.load(Ordering::Relaxed), u64::MAX);
    }
}
