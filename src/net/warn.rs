//! Rate-limited warnings.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Keys kept at most; past that the table is cleared (warnings then log once more).
const MAX_KEYS: usize = 4096;

/// Lets the first occurrence per key per interval (default 60 s) through and counts
/// the rest, reporting the count with the next one that gets through.
///
/// ```
/// use std::time::{Duration, Instant};
/// use eventplane::net::RateLimitedWarn;
/// let warn = RateLimitedWarn::default();
/// let t0 = Instant::now();
/// assert_eq!(warn.check("pub-1", t0), Some(0));
/// assert_eq!(warn.check("pub-1", t0 + Duration::from_secs(1)), None);
/// assert_eq!(warn.check("pub-1", t0 + Duration::from_secs(2)), None);
/// // A minute later: logged again, with the 2 suppressed in between.
/// assert_eq!(warn.check("pub-1", t0 + Duration::from_secs(61)), Some(2));
/// ```
#[derive(Debug)]
pub struct RateLimitedWarn {
    interval: Duration,
    keys: Mutex<HashMap<String, (Instant, u64)>>,
}

impl Default for RateLimitedWarn {
    fn default() -> Self {
        RateLimitedWarn::new(Duration::from_secs(60))
    }
}

impl RateLimitedWarn {
    /// One warning per key per `interval`.
    pub fn new(interval: Duration) -> RateLimitedWarn {
        RateLimitedWarn {
            interval,
            keys: Mutex::new(HashMap::new()),
        }
    }

    /// `Some(suppressed)` when a warning for `key` should be logged now (with how many
    /// were suppressed since the last), `None` when it is suppressed and counted.
    pub fn check(&self, key: &str, now: Instant) -> Option<u64> {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((last, suppressed)) = keys.get_mut(key) {
            if now.saturating_duration_since(*last) < self.interval {
                *suppressed += 1;
                return None;
            }
            let n = *suppressed;
            *last = now;
            *suppressed = 0;
            return Some(n);
        }
        if keys.len() >= MAX_KEYS {
            keys.clear();
        }
        keys.insert(key.to_owned(), (now, 0));
        Some(0)
    }
}
