//! Network helpers with no I/O: jittered [`Backoff`], the [`AddrFilter`] SSRF guard and
//! [`RateLimitedWarn`]. The subscriber, the engine listener and the etcd backend use
//! them; they are public so that code around the crate reconnects, filters and warns
//! the same way.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use eventplane::net::{AddrFilter, Backoff, RateLimitedWarn};
//! // Jittered exponential backoff, never below its minimum: the caller supplies the
//! // randomness (0.0..1.0).
//! let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5))?;
//! assert!(backoff.next_delay(1.0) <= Duration::from_millis(200)); // in [100, 200] ms
//! assert!(backoff.next_delay(0.0) >= Duration::from_millis(100)); // never below min
//! backoff.reset(); // after a healthy period
//!
//! // Which resolved addresses a subscriber may dial (checked at dial time).
//! let filter = AddrFilter::default().allow_cidr("10.0.0.0/8".parse()?);
//! assert!(filter.check("10.1.2.3".parse()?).is_ok());
//! assert!(filter.check("169.254.169.254".parse()?).is_err()); // cloud metadata
//!
//! // One warning per key per interval, counting what it suppressed.
//! let warn = RateLimitedWarn::new(Duration::from_secs(60));
//! let t0 = Instant::now();
//! assert_eq!(warn.check("tcp://10.1.2.3:5557", t0), Some(0));
//! assert_eq!(warn.check("tcp://10.1.2.3:5557", t0 + Duration::from_secs(1)), None);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod addr_filter;
mod backoff;
mod warn;

pub use addr_filter::{AddrFilter, Cidr, CidrError, Refusal, SpecialRange};
pub use backoff::Backoff;
#[cfg(feature = "tunnel")]
pub(crate) use backoff::unit_draw;
pub(crate) use backoff::{random_u64, random_unit};
pub(crate) use warn::ErrorChain;
pub use warn::RateLimitedWarn;
