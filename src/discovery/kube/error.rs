//! How the Kubernetes backend's request failures are classified: denied (401, 403),
//! gone (410: read afresh), or unavailable and worth retrying.

use std::time::Duration;

use crate::discovery::DiscoveryError;

/// Why a request to the API server failed (boxed into [`DiscoveryError::Unavailable`]
/// or [`DiscoveryError::Denied`]).
#[derive(Debug, thiserror::Error)]
pub(crate) enum KubeRequestError {
    #[error("kubernetes {op} failed (namespace {namespace})")]
    Failed {
        op: &'static str,
        namespace: String,
        #[source]
        source: kube::Error,
    },
    #[error("kubernetes {op} timed out after {after:?} (namespace {namespace})")]
    TimedOut {
        op: &'static str,
        namespace: String,
        after: Duration,
    },
}

/// The most of a server's `Retry-After` waited (a longer one waits this long).
pub(crate) const MAX_RETRY_AFTER: Duration = Duration::from_secs(30);

/// An error answer (429, 5xx) that said how long to wait before asking again: its
/// `Retry-After`, in seconds (what an API server sends with a 429 of its priority and
/// fairness, or a 504). It travels as `kube::Error::Service` around this.
#[derive(Debug, thiserror::Error)]
#[error("{answer} (retry after {after:?})")]
pub(crate) struct RetryAfter {
    pub(crate) answer: kube::core::ErrorResponse,
    /// At most [`MAX_RETRY_AFTER`].
    pub(crate) after: Duration,
}

/// The HTTP status of an API error, if the server answered with one.
pub(crate) fn status(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(response) => Some(response.code),
        kube::Error::Service(inner) => inner.downcast_ref::<RetryAfter>().map(|r| r.answer.code),
        _ => None,
    }
}

/// How long the server asked to wait before the next attempt (its `Retry-After` on
/// the answer behind `e`), if it said.
pub(crate) fn retry_after(e: &DiscoveryError) -> Option<Duration> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(KubeRequestError::Failed { source: k, .. }) =
            err.downcast_ref::<KubeRequestError>()
        {
            return match k {
                kube::Error::Service(inner) => inner.downcast_ref::<RetryAfter>().map(|r| r.after),
                _ => None,
            };
        }
        source = err.source();
    }
    None
}

/// Whether the server answered the request behind `e` with HTTP `code` (410: a
/// version or continue token gone; 404: no such object).
pub(crate) fn has_status(e: &DiscoveryError, code: u16) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(KubeRequestError::Failed { source: k, .. }) =
            err.downcast_ref::<KubeRequestError>()
        {
            return status(k) == Some(code);
        }
        source = err.source();
    }
    false
}

/// Whether the server said the version asked for is gone (410).
pub(crate) fn is_gone(e: &DiscoveryError) -> bool {
    has_status(e, 410)
}

/// Wraps a failed request: 401 and 403 are [`DiscoveryError::Denied`] (retrying will
/// not help), everything else [`DiscoveryError::Unavailable`].
pub(crate) fn failed(op: &'static str, namespace: &str, source: kube::Error) -> DiscoveryError {
    let denied = matches!(status(&source), Some(401 | 403));
    let e = Box::new(KubeRequestError::Failed {
        op,
        namespace: namespace.to_owned(),
        source,
    });
    if denied {
        DiscoveryError::Denied(e)
    } else {
        DiscoveryError::Unavailable(e)
    }
}

pub(crate) fn timed_out(op: &'static str, namespace: &str, after: Duration) -> DiscoveryError {
    DiscoveryError::Unavailable(Box::new(KubeRequestError::TimedOut {
        op,
        namespace: namespace.to_owned(),
        after,
    }))
}

/// Runs `fut` within `after`, classifying failures.
pub(crate) async fn within<T>(
    op: &'static str,
    namespace: &str,
    after: Duration,
    fut: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, DiscoveryError> {
    match tokio::time::timeout(after, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(failed(op, namespace, e)),
        Err(_) => Err(timed_out(op, namespace, after)),
    }
}
