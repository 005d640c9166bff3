//! The etcd backend's errors: how request failures are classified (denied, invalid
//! configuration, or unavailable and worth retrying), (why a record was skipped is `records::RecordError`).

use std::time::Duration;

use crate::ConfigError;
use crate::discovery::DiscoveryError;

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
