//! The etcd backend's errors: how request failures are classified (denied, invalid
//! configuration, or unavailable and worth retrying), and why a record was skipped.

use std::time::Duration;

use crate::ConfigError;
use crate::discovery::DiscoveryError;

/// Why a record was skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RecordError {
    #[error("key is outside the channel prefix")]
    ForeignKey,
    #[error("key is not a channel path: {0}")]
    BadKey(String),
    #[error("value of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("value is not a channel record: {0}")]
    BadValue(String),
    #[error("value's id does not match its key")]
    IdMismatch,
    #[error("unsupported transport kind {0:?}")]
    UnsupportedTransport(String),
    #[error("revision {0} is not positive")]
    BadRevision(i64),
    #[error("unsupported scope kind {0:?}")]
    UnsupportedScope(String),
    #[error("endpoint of {len} bytes (or a host over 253) exceeds the {max}-byte limit")]
    EndpointTooLong { len: usize, max: usize },
    /// A well-formed key this backend does not follow (another Dynamo endpoint):
    /// neither an error nor counted.
    #[error("not followed")]
    Unfollowed,
}

/// Why an etcd request failed (boxed into [`DiscoveryError::Unavailable`]).
#[derive(Debug, thiserror::Error)]
pub(super) enum EtcdRequestError {
    #[error("etcd {op} failed (endpoints {endpoints})")]
    Failed {
        op: &'static str,
        endpoints: String,
        #[source]
        source: etcd_client::Error,
    },
    #[error("etcd {op} timed out after {after:?} (endpoints {endpoints})")]
    TimedOut {
        op: &'static str,
        endpoints: String,
        after: Duration,
    },
    #[error("etcd {op} answered without a response header")]
    NoHeader { op: &'static str },
}

pub(super) fn unavailable(e: EtcdRequestError) -> DiscoveryError {
    DiscoveryError::Unavailable(Box::new(e))
}

/// Wraps a failed request: refused credentials or permissions are
/// [`DiscoveryError::Denied`] (retrying will not help), bad arguments
/// [`DiscoveryError::InvalidConfig`], everything else
/// [`DiscoveryError::Unavailable`].
pub(super) fn failed(
    op: &'static str,
    endpoints: String,
    source: etcd_client::Error,
) -> DiscoveryError {
    use etcd_client::Error as E;
    match &source {
        E::InvalidArgs(_) | E::InvalidUri(_) | E::EndpointError(_) => {
            DiscoveryError::InvalidConfig(ConfigError::Invalid {
                field: "endpoints",
                reason: format!("etcd {op} (endpoints {endpoints}): {source}"),
            })
        }
        E::GRpcStatus(status) if is_denial(status.message()) => {
            DiscoveryError::Denied(Box::new(EtcdRequestError::Failed {
                op,
                endpoints,
                source,
            }))
        }
        _ => unavailable(EtcdRequestError::Failed {
            op,
            endpoints,
            source,
        }),
    }
}

/// etcd's messages for authentication and authorization failures.
pub(super) fn is_denial(message: &str) -> bool {
    [
        "authentication failed",
        "permission denied",
        "user name is empty",
        "invalid auth token",
        "user name not found",
    ]
    .iter()
    .any(|m| message.contains(m))
}

pub(super) fn is_lease_not_found(e: &DiscoveryError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        // etcd answers "etcdserver: requested lease not found" to a put and the
        // client reports "lease not found" on the keep-alive stream.
        if err.to_string().contains("lease not found") {
            return true;
        }
        source = err.source();
    }
    false
}
