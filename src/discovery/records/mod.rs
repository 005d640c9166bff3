//! Discovery records other processes write, shared by the backends that read them
//! (etcd, Kubernetes): Dynamo's record layout, the bound on an advertised endpoint,
//! and why a record was skipped. Pure functions, no I/O.

mod dynamo;
mod dynamo_target;
mod endpoint;

pub use dynamo::DynamoRecords;
#[cfg(feature = "etcd")]
pub(crate) use endpoint::check_endpoint;

/// Why a record was skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RecordError {
    #[error("key is outside the channel prefix")]
    ForeignKey,
    #[error("key is not a channel path: {0}")]
    BadKey(String),
    #[cfg(feature = "etcd")]
    #[error("value of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("value is not a channel record: {0}")]
    BadValue(String),
    #[error("value's id does not match its key")]
    IdMismatch,
    #[error("unsupported transport kind {0:?}")]
    UnsupportedTransport(String),
    #[cfg(feature = "etcd")]
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
