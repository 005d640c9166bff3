//! Errors of the discovery layer.

use crate::ConfigError;

/// Everything a [`Discovery`](super::Discovery) backend can fail with.
///
/// ```
/// use eventplane::discovery::{ChannelId, DiscoveryError};
/// let err = ChannelId::new("ns", "c", "t", 1 << 60).unwrap_err();
/// assert!(matches!(err, DiscoveryError::InvalidId { .. }));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// A channel id, path or query was malformed.
    #[error("invalid channel id: {reason}")]
    InvalidId {
        /// What is wrong with it.
        reason: String,
    },
    /// The backend does not support this operation (e.g. registering in a
    /// [`StaticDiscovery`](super::StaticDiscovery)).
    #[error("{operation} is not supported by this backend")]
    Unsupported {
        /// The operation.
        operation: &'static str,
    },
    /// A backend was configured with an invalid value (checked once, when it is
    /// built), or the backend's client refused its arguments.
    /// (The message includes the refused value's; it is not repeated as a source.)
    #[error("invalid discovery configuration: {0}")]
    InvalidConfig(ConfigError),
    /// The backend is unreachable or failed; retry with backoff.
    #[error("discovery backend unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The backend refused our credentials or permissions (e.g. etcd with auth
    /// enabled); retrying will not help until the configuration changes.
    #[error("discovery backend denied the request")]
    Denied(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The watch was ended by the backend (or by a fault injected in tests); watch
    /// again.
    #[error("watch ended: {reason}")]
    WatchEnded {
        /// Why.
        reason: String,
    },
    /// The backend was shut down.
    #[error("discovery backend is closed")]
    Closed,
}

impl DiscoveryError {
    /// `true` when retrying (with backoff) may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            DiscoveryError::Unavailable(_) | DiscoveryError::WatchEnded { .. }
        )
    }

    pub(crate) fn invalid(reason: impl Into<String>) -> Self {
        DiscoveryError::InvalidId {
            reason: reason.into(),
        }
    }
}

impl From<ConfigError> for DiscoveryError {
    fn from(e: ConfigError) -> Self {
        DiscoveryError::InvalidConfig(e)
    }
}
