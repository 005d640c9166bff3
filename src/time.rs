//! Small timer helpers shared by the event loops.

/// Completes at `deadline`, or never when there is none (a `select!` branch that is
/// off until a timer is armed).
pub(crate) async fn sleep_until_opt(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
