//! The broker's reconnect policy (DESIGN §7.2): backoff after failures, a short
//! jittered delay after a rebalance, and no tight loops.

use std::time::{Duration, Instant};

use crate::net::{Backoff, unit_draw};
use crate::tunnel::DrainReason;

/// How long a broker waits before reconnecting (DESIGN §7.2): jittered exponential
/// backoff (1 s → 60 s) after a failure; after a `drain{rebalance}`, a 250–500 ms
/// jittered delay, unless another rebalance came in the last 60 s (then the backoff:
/// no tight loops).
///
/// ```
/// use std::time::{Duration, Instant};
/// use eventplane::tunnel::protocol::{DrainReason, Reconnect};
/// let mut reconnect = Reconnect::default();
/// let now = Instant::now();
/// let first = reconnect.after_drain(DrainReason::Rebalance, now, 0.5);
/// assert!(first >= Duration::from_millis(250) && first <= Duration::from_millis(500));
/// // A second rebalance within 60 s waits like a failure (1 to 2 s at first).
/// let second = reconnect.after_drain(DrainReason::Rebalance, now + Duration::from_secs(5), 0.0);
/// assert_eq!(second, Duration::from_secs(1));
/// ```
#[derive(Debug, Clone)]
pub struct Reconnect {
    backoff: Backoff,
    last_rebalance: Option<Instant>,
}

/// The window in which a second rebalance falls back to the normal backoff.
pub const REBALANCE_WINDOW: Duration = Duration::from_secs(60);

impl Default for Reconnect {
    fn default() -> Self {
        Reconnect {
            backoff: Backoff::checked(Duration::from_secs(1), Duration::from_secs(60)),
            last_rebalance: None,
        }
    }
}

impl Reconnect {
    /// A policy whose failures back off along `backoff` (the default: 1 s doubling
    /// to 60 s, jittered).
    pub fn with_backoff(backoff: Backoff) -> Reconnect {
        Reconnect {
            backoff,
            last_rebalance: None,
        }
    }

    /// The delay after a failed or lost session; `random` in `0.0..=1.0`.
    pub fn after_failure(&mut self, random: f64) -> Duration {
        self.backoff.next_delay(random)
    }

    /// Whether a rebalance at `now` would be throttled: another came within
    /// [`REBALANCE_WINDOW`].
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use eventplane::tunnel::protocol::{DrainReason, Reconnect};
    /// let (mut reconnect, now) = (Reconnect::default(), Instant::now());
    /// assert!(!reconnect.is_throttled(now));
    /// reconnect.after_drain(DrainReason::Rebalance, now, 0.5);
    /// assert!(reconnect.is_throttled(now + Duration::from_secs(59)));
    /// assert!(!reconnect.is_throttled(now + Duration::from_secs(61)));
    /// ```
    pub fn is_throttled(&self, now: Instant) -> bool {
        self.last_rebalance
            .is_some_and(|t| now.saturating_duration_since(t) < REBALANCE_WINDOW)
    }

    /// The delay after the router drained this broker for `reason`.
    pub fn after_drain(&mut self, reason: DrainReason, now: Instant, random: f64) -> Duration {
        let recent = self.is_throttled(now);
        match reason {
            DrainReason::Rebalance if !recent => {
                self.last_rebalance = Some(now);
                // A NaN draw takes the longest delay (as `Backoff` does), never a panic.
                Duration::from_millis(250) + Duration::from_millis(250).mul_f64(unit_draw(random))
            }
            DrainReason::Rebalance => {
                self.last_rebalance = Some(now);
                self.backoff.next_delay(random)
            }
            _ => self.backoff.next_delay(random),
        }
    }

    /// A session held (the broker calls it once a welcomed session lived
    /// 10 s): the next failure starts the backoff over.
    pub fn reset(&mut self) {
        self.backoff.reset();
    }
}
