//! A conformance suite for [`Discovery`] backends: one async check per rule of the
//! watch contract (see the [module docs](super)) plus register / list / unregister /
//! re-register / TTL behaviour.
//!
//! Every check takes a fresh backend, uses its own namespace, and returns a
//! [`ConformanceFailure`] instead of panicking, so a test can also prove that a broken
//! backend *fails* a check. [`run_all`] runs them all.
//!
//! ```
//! use std::sync::Arc;
//! use eventplane::discovery::{Discovery, MemoryDiscovery};
//! use eventplane::discovery::conformance::{self, Settings};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let failures = conformance::run_all(
//!     || async { Arc::new(MemoryDiscovery::new()) as Arc<dyn Discovery> },
//!     &Settings::default(),
//! )
//! .await;
//! assert!(failures.is_empty(), "{failures:?}");
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::Discovery;

/// Knobs for the suite.
///
/// ```
/// use std::time::Duration;
/// use eventplane::discovery::conformance::Settings;
/// // For a backend whose leases last 3 s and whose watch buffer is 256 events.
/// let settings = Settings::default().with_ttl(Duration::from_secs(3)).with_overflow_churn(1000);
/// assert_eq!(settings.ttl, Some(Duration::from_secs(3)));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settings {
    /// Registrations to churn (register + unregister) while a watcher does not poll;
    /// should exceed the backend's per-watcher buffer. Default 3000.
    pub overflow_churn: usize,
    /// The backend's lease TTL, to check that a detached registration expires; `None`
    /// skips the check. Default `None`.
    pub ttl: Option<Duration>,
    /// How long any one expected event or state may take. Default 10 s.
    pub deadline: Duration,
    /// How long to watch for spurious events after the initial sync. Default 200 ms.
    pub quiet: Duration,
    /// Whether readers return a registration's worker identity
    /// ([`check_worker_identity`]). Default `true`; `false` only for a backend that
    /// documents otherwise (etcd with Dynamo's records writes the identity into
    /// Dynamo's `event_sources` record, which its reader does not join).
    pub worker_identity: bool,
    /// Whether every reader sees a registration with the incarnation the backend gave
    /// it (`Registration::instance`). Default `true`; `false` for a backend whose
    /// records carry no version of their own (Kubernetes: one resource holds all of a
    /// process's records), whose readers number a record by the version at which they
    /// first saw it: then instances a reader listed are compared without their
    /// incarnations, while everything a watch saw happen is still compared exactly
    /// (and rule 5 still holds).
    pub exact_incarnations: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            overflow_churn: 3000,
            ttl: None,
            deadline: Duration::from_secs(10),
            quiet: Duration::from_millis(200),
            worker_identity: true,
            exact_incarnations: true,
        }
    }
}

impl Settings {
    /// With the TTL check enabled for a backend whose lease TTL is `ttl`.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// With a different bound on how long an expected event may take.
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// With a different churn count for the overflow check.
    pub fn with_overflow_churn(mut self, churn: usize) -> Self {
        self.overflow_churn = churn;
        self
    }

    /// For a backend whose readers number incarnations by when they saw a record
    /// (see [`Settings::exact_incarnations`]).
    pub fn with_observed_incarnations(mut self) -> Self {
        self.exact_incarnations = false;
        self
    }

    /// Without the worker-identity check (see [`Settings::worker_identity`]).
    pub fn without_worker_identity(mut self) -> Self {
        self.worker_identity = false;
        self
    }
}

/// A violated rule.
///
/// ```
/// use eventplane::discovery::conformance::ConformanceFailure;
/// let failure = ConformanceFailure { check: "initial_sync", reason: "no Resync".into() };
/// assert_eq!(failure.to_string(), "initial_sync: no Resync");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConformanceFailure {
    /// The check's name.
    pub check: &'static str,
    /// What went wrong.
    pub reason: String,
}

impl fmt::Display for ConformanceFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.check, self.reason)
    }
}

impl std::error::Error for ConformanceFailure {}

type CheckResult = Result<(), ConformanceFailure>;

fn fail(check: &'static str, reason: impl Into<String>) -> ConformanceFailure {
    ConformanceFailure {
        check,
        reason: reason.into(),
    }
}

/// Runs every check, each against a fresh backend from `factory`; returns the
/// failures (empty when the backend conforms).
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{Discovery, MemoryDiscovery};
/// use eventplane::discovery::conformance::{run_all, Settings};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let failures = run_all(
///     || async { Arc::new(MemoryDiscovery::new()) as Arc<dyn Discovery> },
///     &Settings::default(),
/// )
/// .await;
/// assert!(failures.is_empty(), "{failures:?}");
/// # }
/// ```
pub async fn run_all<F, Fut>(factory: F, settings: &Settings) -> Vec<ConformanceFailure>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<dyn Discovery>>,
{
    let mut failures = Vec::new();
    macro_rules! run {
        ($check:ident) => {
            if let Err(f) = $check(&*factory().await, settings).await {
                failures.push(f);
            }
        };
    }
    run!(check_initial_sync);
    run!(check_empty_initial_resync);
    run!(check_no_gap_between_snapshot_and_watch);
    run!(check_incremental_changes);
    run!(check_overflow_collapses_into_resync);
    run!(check_stale_removal_suppressed);
    run!(check_cancel_and_drop_release_watch);
    run!(check_register_list_unregister);
    run!(check_reregister_incarnations);
    if settings.worker_identity {
        run!(check_worker_identity);
    }
    run!(check_exact_query_matching);
    if settings.ttl.is_some() {
        run!(check_ttl_expiry);
    }
    failures
}

mod checks;
mod harness;
mod mirror;

pub use checks::{
    check_cancel_and_drop_release_watch, check_empty_initial_resync, check_exact_query_matching,
    check_incremental_changes, check_initial_sync, check_no_gap_between_snapshot_and_watch,
    check_overflow_collapses_into_resync, check_register_list_unregister,
    check_reregister_incarnations, check_stale_removal_suppressed, check_ttl_expiry,
    check_worker_identity,
};
pub use mirror::Mirror;
