//! `FaultDiscovery`: wraps a backend and injects the failures consumers must survive.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_core::Stream;
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;

use super::{
    BoxFuture, ChannelId, Discovery, DiscoveryError, DiscoveryEvent, DiscoveryStats,
    DiscoveryStream, Instance, Query, Registration, Transport, WorkerIdentity,
};

/// A [`Discovery`] wrapper that, on command from its [`FaultControl`], ends or fails
/// every open watch, fails the next `watch` calls, delays events, or makes every open
/// watch emit a backend-side `Resync` — to test consumers such as the dynamic
/// subscriber.
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{Discovery, DiscoveryEvent, FaultDiscovery, MemoryDiscovery, Query};
/// use tokio_util::sync::CancellationToken;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
/// let (discovery, faults) = FaultDiscovery::new(Arc::new(MemoryDiscovery::new()));
/// let mut watch = discovery.watch(Query::new("ns"), CancellationToken::new()).await?;
/// assert!(matches!(watch.next().await, Some(Ok(DiscoveryEvent::Resync(_)))));
/// faults.fail_watches("injected");
/// assert!(matches!(watch.next().await, Some(Err(_))));
/// assert!(watch.next().await.is_none());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct FaultDiscovery {
    inner: Arc<dyn Discovery>,
    shared: Arc<Shared>,
}

/// Commands for a [`FaultDiscovery`]; cheap to clone.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use eventplane::discovery::{FaultDiscovery, MemoryDiscovery};
/// let (_discovery, faults) = FaultDiscovery::new(Arc::new(MemoryDiscovery::new()));
/// faults.fail_next_watch_calls(2);          // the next two `watch` calls fail
/// faults.delay_events(Some(Duration::from_millis(50)));
/// faults.inject_resync();                   // open watches emit a Resync
/// faults.end_watches();                     // and then end
/// assert_eq!(faults.open_watches(), 0);
/// ```
#[derive(Debug, Clone)]
pub struct FaultControl {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    end_gen: AtomicU64,
    fail_gen: AtomicU64,
    resync_gen: AtomicU64,
    failing_watch_calls: AtomicUsize,
    open: AtomicUsize,
    next_stream: AtomicU64,
    reason: Mutex<String>,
    delay: Mutex<Option<Duration>>,
    wakers: Mutex<HashMap<u64, Waker>>,
}

impl Shared {
    fn wake_all(&self) {
        let wakers: Vec<Waker> = lock(&self.wakers).values().cloned().collect();
        for w in wakers {
            w.wake();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl FaultDiscovery {
    /// Wraps `inner`; faults are injected through the returned control.
    pub fn new(inner: Arc<dyn Discovery>) -> (FaultDiscovery, FaultControl) {
        let shared = Arc::new(Shared::default());
        (
            FaultDiscovery {
                inner,
                shared: shared.clone(),
            },
            FaultControl { shared },
        )
    }
}

impl FaultControl {
    /// Every open watch ends (returns `None`), as a backend that drops streams would.
    pub fn end_watches(&self) {
        self.shared.end_gen.fetch_add(1, Ordering::SeqCst);
        self.shared.wake_all();
    }

    /// Every open watch yields `Err(WatchEnded { reason })`, then ends.
    pub fn fail_watches(&self, reason: &str) {
        *lock(&self.shared.reason) = reason.to_owned();
        self.shared.fail_gen.fetch_add(1, Ordering::SeqCst);
        self.shared.wake_all();
    }

    /// The next `count` calls to `watch` fail with `Unavailable`.
    pub fn fail_next_watch_calls(&self, count: usize) {
        self.shared
            .failing_watch_calls
            .store(count, Ordering::SeqCst);
    }

    /// Every open watch emits `Resync(current set)`, as after a backend reconnect.
    pub fn inject_resync(&self) {
        self.shared.resync_gen.fetch_add(1, Ordering::SeqCst);
        self.shared.wake_all();
    }

    /// Holds every event for `delay` before delivering it (`None`: no delay).
    pub fn delay_events(&self, delay: Option<Duration>) {
        *lock(&self.shared.delay) = delay;
    }

    /// Watch streams currently open.
    pub fn open_watches(&self) -> usize {
        self.shared.open.load(Ordering::SeqCst)
    }
}

impl Discovery for FaultDiscovery {
    fn register_with(
        &self,
        id: ChannelId,
        transport: Transport,
        worker: Option<WorkerIdentity>,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        self.inner.register_with(id, transport, worker)
    }

    fn register_instance(
        &self,
        instance: Instance,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        self.inner.register_instance(instance)
    }

    fn list(&self, query: Query) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>> {
        self.inner.list(query)
    }

    fn watch(
        &self,
        query: Query,
        cancel: CancellationToken,
    ) -> BoxFuture<'_, Result<DiscoveryStream, DiscoveryError>> {
        let failing = self
            .shared
            .failing_watch_calls
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        Box::pin(async move {
            if failing {
                return Err(DiscoveryError::Unavailable("injected watch failure".into()));
            }
            let inner = self.inner.watch(query.clone(), cancel).await?;
            let s = &self.shared;
            s.open.fetch_add(1, Ordering::SeqCst);
            Ok(DiscoveryStream::new(FaultWatch {
                inner,
                discovery: self.inner.clone(),
                query,
                id: s.next_stream.fetch_add(1, Ordering::SeqCst),
                end_gen: s.end_gen.load(Ordering::SeqCst),
                fail_gen: s.fail_gen.load(Ordering::SeqCst),
                resync_gen: s.resync_gen.load(Ordering::SeqCst),
                shared: s.clone(),
                resync: None,
                held: None,
                done: false,
            }))
        })
    }

    fn stats(&self) -> DiscoveryStats {
        self.inner.stats()
    }
}

struct FaultWatch {
    inner: DiscoveryStream,
    discovery: Arc<dyn Discovery>,
    query: Query,
    id: u64,
    end_gen: u64,
    fail_gen: u64,
    resync_gen: u64,
    shared: Arc<Shared>,
    resync: Option<BoxFuture<'static, Result<Vec<Instance>, DiscoveryError>>>,
    held: Option<(DiscoveryEvent, Pin<Box<Sleep>>)>,
    done: bool,
}

type Item = Result<DiscoveryEvent, DiscoveryError>;

impl FaultWatch {
    fn finish(&mut self, item: Option<Item>) -> Poll<Option<Item>> {
        self.done = item.is_none() || matches!(item, Some(Err(_)));
        Poll::Ready(item)
    }
}

impl Stream for FaultWatch {
    type Item = Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        lock(&this.shared.wakers).insert(this.id, cx.waker().clone());
        if this.shared.end_gen.load(Ordering::SeqCst) != this.end_gen {
            return this.finish(None);
        }
        if this.shared.fail_gen.load(Ordering::SeqCst) != this.fail_gen {
            let reason = lock(&this.shared.reason).clone();
            return this.finish(Some(Err(DiscoveryError::WatchEnded { reason })));
        }
        let generation = this.shared.resync_gen.load(Ordering::SeqCst);
        if generation != this.resync_gen && this.resync.is_none() {
            this.resync_gen = generation;
            let d = this.discovery.clone();
            let q = this.query.clone();
            this.resync = Some(Box::pin(async move { d.list(q).await }));
        }
        if let Some(fut) = this.resync.as_mut() {
            if let Poll::Ready(r) = fut.as_mut().poll(cx) {
                this.resync = None;
                return match r {
                    Ok(all) => Poll::Ready(Some(Ok(DiscoveryEvent::Resync(all)))),
                    Err(e) => this.finish(Some(Err(e))),
                };
            }
            return Poll::Pending;
        }
        if let Some((_, sleep)) = this.held.as_mut() {
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            if let Some((ev, _)) = this.held.take() {
                return Poll::Ready(Some(Ok(ev)));
            }
        }
        match Pin::new(&mut this.inner).poll_next(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => this.finish(None),
            Poll::Ready(Some(Err(e))) => this.finish(Some(Err(e))),
            Poll::Ready(Some(Ok(ev))) => {
                let delay = *lock(&this.shared.delay);
                match delay {
                    None => Poll::Ready(Some(Ok(ev))),
                    Some(d) => {
                        let mut sleep = Box::pin(tokio::time::sleep(d));
                        if sleep.as_mut().poll(cx).is_ready() {
                            return Poll::Ready(Some(Ok(ev)));
                        }
                        this.held = Some((ev, sleep));
                        Poll::Pending
                    }
                }
            }
        }
    }
}

impl Drop for FaultWatch {
    fn drop(&mut self) {
        lock(&self.shared.wakers).remove(&self.id);
        self.shared.open.fetch_sub(1, Ordering::SeqCst);
    }
}
