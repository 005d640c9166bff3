//! The tunnel's errors.

use crate::tunnel::{CloseCode, RefuseCode, SessionEnd};

/// Why a tunnel operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TunnelError {
    /// A setting, file or credential is refused.
    #[error("invalid tunnel setting {field}: {reason}")]
    Config {
        /// The setting.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// TLS refused the configuration or the peer.
    #[error("TLS error")]
    Tls(#[source] rustls::Error),
    /// A socket failed.
    #[error("I/O error")]
    Io(#[from] std::io::Error),
    /// HTTP/2 failed.
    #[error("HTTP/2 error")]
    Http(#[from] hyper::Error),
    /// The bus refused the credential (HTTP 401).
    #[error("the event bus refused the credential")]
    Unauthorized,
    /// The bus answered with an unexpected HTTP status.
    #[error("the event bus answered HTTP {0}")]
    Status(u16),
    /// The session ended.
    #[error("the tunnel session ended")]
    Session(#[source] SessionEnd),
    /// No connected broker covers the namespace.
    #[error("no connected broker covers namespace {0:?}")]
    NoBroker(String),
    /// The broker refused the subscribe.
    #[error("the broker refused the stream: {0}")]
    Refused(RefuseCode),
    /// The broker closed the stream.
    #[error("the broker closed the stream: {0}")]
    Closed(CloseCode),
    /// A stage took longer than its deadline.
    #[error("{0} timed out")]
    Timeout(&'static str),
    /// The bus or broker is shut down.
    #[error("the tunnel is shut down")]
    Shutdown,
}
