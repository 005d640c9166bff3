//! Jittered exponential backoff.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use crate::config::{self, ConfigError};

/// Jittered exponential backoff with a floor: attempt *n* (from 0) waits a uniformly
/// random time in `[min, min(max, min × multiplier^(n+1))]`. `min` is never undercut
/// (a retry storm against a peer that just failed cannot happen), and the window
/// doubles (by default) up to `max`, so reconnecting clients spread out. Pure: the
/// caller passes the randomness, so tests are deterministic.
///
/// ```
/// use std::time::Duration;
/// use eventplane::net::Backoff;
/// let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5))?;
/// assert_eq!(b.next_delay(0.0), Duration::from_millis(100)); // never below min
/// assert_eq!(b.next_delay(1.0), Duration::from_millis(400)); // attempt 1: [100, 400] ms
/// assert_eq!(b.next_delay(0.5), Duration::from_millis(450)); // attempt 2: [100, 800] ms
/// b.reset();
/// assert_eq!(b.next_delay(1.0), Duration::from_millis(200)); // attempt 0: [100, 200] ms
/// assert!(Backoff::new(Duration::from_secs(2), Duration::from_secs(1)).is_err()); // max below min
/// # Ok::<(), eventplane::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    multiplier: f64,
    attempt: u32,
}

impl Backoff {
    /// From `min` to `max`, doubling; [`ConfigError`] (field `backoff`) when `min` is
    /// zero or `max` is below it.
    pub fn new(min: Duration, max: Duration) -> Result<Backoff, ConfigError> {
        config::backoff_range("backoff", min, max)?;
        Ok(Backoff::checked(min, max))
    }

    /// From `min` to `max`, already checked by the caller's configuration.
    pub(crate) fn checked(min: Duration, max: Duration) -> Backoff {
        Backoff {
            min,
            max,
            multiplier: 2.0,
            attempt: 0,
        }
    }

    /// Changes the growth factor; [`ConfigError`] (field `multiplier`) unless it is
    /// finite and at least 1.
    pub fn with_multiplier(mut self, multiplier: f64) -> Result<Backoff, ConfigError> {
        if !(multiplier.is_finite() && multiplier >= 1.0) {
            return Err(ConfigError::OutOfRange {
                field: "multiplier",
                reason: "must be finite and at least 1",
            });
        }
        self.multiplier = multiplier;
        Ok(self)
    }

    /// The longest delay of the current attempt: `min × multiplier^(attempt + 1)`,
    /// at most `max`. Never panics: any overflow (a huge multiplier, `Duration::MAX`
    /// bounds) saturates at `max`.
    pub fn ceiling(&self) -> Duration {
        if self.min.is_zero() {
            return Duration::ZERO;
        }
        let factor = self
            .multiplier
            .powi(self.attempt.saturating_add(1).min(64) as i32);
        let ceiling = self.min.as_secs_f64() * factor;
        // Anything not below `max` (NaN and infinity included) is `max`.
        if ceiling.partial_cmp(&self.max.as_secs_f64()) != Some(std::cmp::Ordering::Less) {
            return self.max;
        }
        Duration::try_from_secs_f64(ceiling)
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// The next delay for `random` in `[0, 1]` (clamped), and advances the attempt.
    pub fn next_delay(&mut self, random: f64) -> Duration {
        let random = unit_draw(random);
        let ceiling = self.ceiling();
        let floor = self.min.min(ceiling);
        let spread = (ceiling - floor).as_secs_f64() * random;
        let delay = Duration::try_from_secs_f64(spread)
            .map_or(ceiling, |jitter| floor.saturating_add(jitter))
            .min(ceiling);
        self.attempt = self.attempt.saturating_add(1);
        delay
    }

    /// Attempts since the last reset.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Back to the first attempt (after a healthy period).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// A caller's random draw made safe to scale a delay by: clamped into `[0, 1]`, and a
/// NaN or infinity taken as 1 (the longest delay), never a panic.
pub(crate) fn unit_draw(random: f64) -> f64 {
    if random.is_finite() {
        random.clamp(0.0, 1.0)
    } else {
        1.0
    }
}

/// A random `u64` from the standard library's per-process random hash keys (no
/// dependency; fine for jitter and ids, not for cryptography).
pub(crate) fn random_u64() -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
    );
    h.finish()
}

/// A random number in `[0, 1)`, for [`Backoff::next_delay`].
pub(crate) fn random_unit() -> f64 {
    (random_u64() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_panics_on_any_configuration() {
        let durations = [
            Duration::ZERO,
            Duration::from_nanos(1),
            Duration::from_millis(100),
            Duration::from_secs(u64::MAX / 2),
            Duration::MAX,
        ];
        let multipliers = [0.0, 1.0, 2.0, 1e308, f64::INFINITY, f64::NAN, -5.0];
        for min in durations {
            for max in durations {
                for m in multipliers {
                    let built = Backoff::new(min, max).and_then(|b| b.with_multiplier(m));
                    let valid = !min.is_zero() && max >= min && m.is_finite() && m >= 1.0;
                    assert_eq!(built.is_ok(), valid, "{min:?} {max:?} {m}");
                    // Whatever the crate builds internally never panics either.
                    let mut b = Backoff::checked(min, max.max(min));
                    b.multiplier = if m.is_finite() { m.max(1.0) } else { 2.0 };
                    for i in 0..200 {
                        let r = [0.0, 0.5, 1.0, f64::NAN, 7.0][i % 5];
                        let d = b.next_delay(r);
                        assert!(d <= max.max(min), "{min:?} {max:?} {m} -> {d:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn grows_and_caps() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5)).unwrap();
        let ceilings: Vec<u128> = (0..10).map(|_| b.next_delay(1.0).as_millis()).collect();
        assert_eq!(
            ceilings,
            vec![200, 400, 800, 1600, 3200, 5000, 5000, 5000, 5000, 5000]
        );
        for _ in 0..1000 {
            b.next_delay(1.0);
        }
        assert_eq!(b.next_delay(1.0), Duration::from_secs(5));
        assert_eq!(b.next_delay(f64::NAN), Duration::from_secs(5));
        assert_eq!(b.next_delay(-3.0), Duration::from_millis(100));
    }

    #[test]
    fn never_below_the_minimum() {
        let (min, max) = (Duration::from_secs(1), Duration::from_secs(60));
        let mut b = Backoff::new(min, max).unwrap();
        for i in 0..100 {
            let d = b.next_delay(f64::from(i % 10) / 10.0);
            assert!((min..=max).contains(&d), "attempt {i}: {d:?}");
        }
        // A fixed backoff (min = max) waits exactly that, whatever the draw.
        let mut fixed = Backoff::new(min, min).unwrap();
        assert_eq!((fixed.next_delay(0.0), fixed.next_delay(1.0)), (min, min));
    }

    #[test]
    fn randomness_is_in_range() {
        for _ in 0..1000 {
            let r = random_unit();
            assert!((0.0..1.0).contains(&r));
        }
        assert_ne!(random_u64(), random_u64());
    }
}
