//! Rate-limited warnings.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Keys kept at most (four per publisher a `DynamicSubscriber` may follow). When full,
/// keys whose interval has passed are dropped (they would log at once anyway); if none
/// has, the table is cleared (warnings then log once more).
const MAX_KEYS: usize = 16_384;
/// Longest key stored as given; a longer one (an endpoint from a hostile discovery
/// record, say) is stored as its first bytes and a hash of the whole key.
const MAX_KEY_LEN: usize = 128;

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
        let key = bounded_key(key);
        let key = key.as_ref();
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
            let interval = self.interval;
            keys.retain(|_, (last, _)| now.saturating_duration_since(*last) < interval);
            if keys.len() >= MAX_KEYS {
                keys.clear();
            }
        }
        keys.insert(key.to_owned(), (now, 0));
        Some(0)
    }
}

/// `key`, or for a key longer than [`MAX_KEY_LEN`] its first bytes and a hash of it,
/// so the table holds at most `MAX_KEYS × MAX_KEY_LEN` bytes of keys (2 MiB).
fn bounded_key(key: &str) -> std::borrow::Cow<'_, str> {
    if key.len() <= MAX_KEY_LEN {
        return key.into();
    }
    let mut cut = MAX_KEY_LEN - 17;
    while !key.is_char_boundary(cut) {
        cut -= 1;
    }
    let hash = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
    format!("{}#{hash:016x}", key.get(..cut).unwrap_or_default()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_keys_are_bounded_and_still_distinct() {
        let warn = RateLimitedWarn::default();
        let now = Instant::now();
        let a = format!("conn:{}", "é".repeat(40_000));
        let b = format!("{a}x");
        assert_eq!(warn.check(&a, now), Some(0));
        assert_eq!(warn.check(&b, now), Some(0));
        assert_eq!(warn.check(&a, now), None);
        let keys = warn.keys.lock().unwrap();
        assert!(keys.keys().all(|k| k.len() <= MAX_KEY_LEN));
        assert_eq!(keys.len(), 2);
    }
}

/// An error and its sources, `: `-separated, for log fields: `error = %ErrorChain(&e)`.
/// (`%e` alone shows only the outermost message, "I/O error" without its cause.)
pub(crate) struct ErrorChain<'a>(pub(crate) &'a (dyn std::error::Error + 'a));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(inner) = source {
            write!(f, ": {inner}")?;
            source = inner.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod chain_tests {
    use super::ErrorChain;

    #[test]
    fn the_chain_names_every_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = crate::zmtp::Error::Io(io);
        assert_eq!(ErrorChain(&e).to_string(), "I/O error: refused");
    }
}
