//! One ordered stream of deliveries and notices: [`DynamicSubscriber::recv_item`].

use super::{Delivery, DynamicSubscriber, Notice};

/// One thing [`DynamicSubscriber::recv_item`] hands out: a message, or something
/// that happened to a publisher, in the order a router must apply them.
#[derive(Debug)]
#[non_exhaustive]
pub enum Item {
    /// A message.
    Delivery(Delivery),
    /// A lifecycle notice (only with [`notices`](super::DynamicSubscriberBuilder::notices)
    /// enabled).
    Notice(Notice),
}

impl DynamicSubscriber {
    /// The next delivery or notice, in one ordered stream: what a router keeping
    /// per-publisher state applies as it comes, with no second channel to
    /// interleave by hand. `None` once shut down and drained. Cancel-safe.
    ///
    /// Deliveries come in batches of up to
    /// [`recv_batch`](super::DynamicSubscriberBuilder::recv_batch) taken round-robin across
    /// publishers;
    /// the notices queued by then follow the batch. So a publisher's
    /// [`Notice::Departed`] comes after its last delivery, and notices arrive while no
    /// message does. A [`Notice::Connected`] or [`Notice::Gap`] may follow the batch
    /// holding the first messages after it: a KV router
    /// checks its events' dense ids instead, which show every loss in order
    /// ([`kv::router::IndexFeed`](crate::kv::router::IndexFeed) does). Use either this or
    /// [`recv`](Self::recv) / [`recv_many`](Self::recv_many) and
    /// [`take_notices`](Self::take_notices), not both: what this took is handed out
    /// only by this.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
    /// use eventplane::publish::EventPublisher;
    /// use eventplane::subscriber::{DynamicSubscriber, Item, Notice};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    /// let mut router = DynamicSubscriber::builder(discovery.clone(), Query::new("ns"))
    ///     .topic("t")
    ///     .notices(1024)
    ///     .spawn()?;
    /// let publisher = EventPublisher::builder(discovery, "ns", "c", "t").build().await?;
    /// publisher.wait_for_subscribers(1).await;
    /// publisher.publish("hello");
    /// publisher.shutdown().await;
    /// let mut seen = Vec::new();
    /// while let Some(item) = router.recv_item().await {
    ///     match item {
    ///         Item::Delivery(d) => seen.push(format!("message #{:?}", d.sequence)),
    ///         Item::Notice(Notice::Connected(_)) => seen.push("connected".into()),
    ///         Item::Notice(Notice::Departed(_)) => {
    ///             seen.push("departed".into());
    ///             break;
    ///         }
    ///         Item::Notice(_) | _ => {}
    ///     }
    /// }
    /// assert_eq!(seen, ["connected", "message #Some(0)", "departed"]);
    /// # Ok(()) }
    /// ```
    pub async fn recv_item(&mut self) -> Option<Item> {
        loop {
            if let Some(item) = self.items.pop_front() {
                return Some(item);
            }
            // Every delivery taken so far was handed out: notices queued by now go
            // first.
            if self.queue_notices() > 0 {
                continue;
            }
            let notices = self.handle.shared.clone();
            let max = self.recv_batch;
            let taken = tokio::select! {
                biased;
                n = std::future::poll_fn(|cx| self.merge.poll_recv_many(cx, &mut self.scratch, max)) => Some(n),
                () = notices.notices.ready() => None,
            };
            match taken {
                Some(0) => {
                    // Shut down and drained: what was noticed last, then the end.
                    self.queue_notices();
                    return self.items.pop_front();
                }
                Some(_) => {
                    self.items
                        .extend(self.scratch.drain(..).map(Item::Delivery));
                    self.queue_notices();
                }
                None => {}
            }
        }
    }

    /// Moves the queued notices behind what `items` holds; returns how many.
    fn queue_notices(&mut self) -> usize {
        let mut notices = Vec::new();
        let n = self.handle.shared.notices.take(&mut notices);
        self.items.extend(notices.into_iter().map(Item::Notice));
        n
    }
}
