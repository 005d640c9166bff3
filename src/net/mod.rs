//! Network helpers with no I/O: jittered [`Backoff`], the [`AddrFilter`] SSRF guard and
//! [`RateLimitedWarn`].

mod addr_filter;
mod backoff;
mod warn;

pub use addr_filter::{AddrFilter, Cidr, CidrError, Refusal, SpecialRange};
pub use backoff::Backoff;
pub(crate) use backoff::{random_u64, random_unit};
pub use warn::RateLimitedWarn;
