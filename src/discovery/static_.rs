//! `StaticDiscovery`: a fixed set of instances.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::ConfigError;

use super::{
    BoxFuture, ChannelId, Discovery, DiscoveryError, DiscoveryEvent, DiscoveryStats,
    DiscoveryStream, Instance, Query, Registration, Transport, WorkerIdentity,
};

/// A fixed set of instances: for examples, tests and deployments whose publishers
/// never move. Watches deliver the matching set and a `Resync`, then stay quiet until
/// cancelled; `register` is unsupported.
///
/// ```
/// use eventplane::discovery::{Discovery, Query, StaticDiscovery};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
/// let discovery = StaticDiscovery::from_endpoints(
///     "ns", "worker", "kv-events",
///     ["tcp://10.0.0.1:5557", "tcp://10.0.0.2:5557"],
/// )?;
/// assert_eq!(discovery.list(Query::new("ns")).await?.len(), 2);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct StaticDiscovery {
    instances: Arc<Vec<Instance>>,
}

impl StaticDiscovery {
    /// These instances (incarnations as given).
    pub fn new(instances: Vec<Instance>) -> StaticDiscovery {
        StaticDiscovery {
            instances: Arc::new(instances),
        }
    }

    /// One instance per endpoint under `namespace/component/topic`, with publisher ids
    /// 0, 1, 2, … in order and incarnation 1. An endpoint that is not `tcp://host:port`
    /// is refused ([`DiscoveryError::InvalidConfig`], field `endpoints`).
    ///
    /// ```
    /// use eventplane::discovery::{DiscoveryError, StaticDiscovery};
    /// let err = StaticDiscovery::from_endpoints("ns", "c", "t", ["127.0.0.1:5555"]).unwrap_err();
    /// assert!(matches!(err, DiscoveryError::InvalidConfig(_)));
    /// assert!(err.to_string().contains("only tcp://"), "{err}");
    /// ```
    pub fn from_endpoints<I, S>(
        namespace: &str,
        component: &str,
        topic: &str,
        endpoints: I,
    ) -> Result<StaticDiscovery, DiscoveryError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let instances = endpoints
            .into_iter()
            .enumerate()
            .map(|(i, ep)| {
                let id = ChannelId::new(namespace, component, topic, i as u64)?;
                let ep = ep.into();
                // Refused now, not found out by a dial that can only time out.
                if let Err(e) = crate::zmtp::parse_tcp(&ep) {
                    return Err(DiscoveryError::InvalidConfig(ConfigError::Invalid {
                        field: "endpoints",
                        reason: e.to_string(),
                    }));
                }
                Ok(Instance::new(id, Transport::zmq(ep), 1))
            })
            .collect::<Result<Vec<_>, DiscoveryError>>()?;
        Ok(StaticDiscovery::new(instances))
    }

    fn matching(&self, query: &Query) -> Vec<Instance> {
        self.instances
            .iter()
            .filter(|i| query.matches(&i.id))
            .cloned()
            .collect()
    }
}

impl Discovery for StaticDiscovery {
    fn register_with(
        &self,
        _id: ChannelId,
        _transport: Transport,
        _worker: Option<WorkerIdentity>,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        Box::pin(async {
            Err(DiscoveryError::Unsupported {
                operation: "register",
            })
        })
    }

    fn list(&self, query: Query) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>> {
        let out = self.matching(&query);
        Box::pin(async move { Ok(out) })
    }

    fn watch(
        &self,
        query: Query,
        cancel: CancellationToken,
    ) -> BoxFuture<'_, Result<DiscoveryStream, DiscoveryError>> {
        let snapshot = self.matching(&query);
        let mut events: Vec<DiscoveryEvent> = snapshot
            .iter()
            .cloned()
            .map(DiscoveryEvent::Added)
            .collect();
        events.push(DiscoveryEvent::Resync(snapshot));
        let stream = Fixed {
            events: events.into(),
        };
        Box::pin(async move { Ok(DiscoveryStream::with_cancellation(stream, cancel)) })
    }

    fn stats(&self) -> DiscoveryStats {
        DiscoveryStats {
            registrations: self.instances.len(),
            ..DiscoveryStats::default()
        }
    }
}

/// Fixed events, then silence (until the watch's token ends the stream).
struct Fixed {
    events: std::collections::VecDeque<DiscoveryEvent>,
}

impl futures_core::Stream for Fixed {
    type Item = Result<DiscoveryEvent, DiscoveryError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        match self.events.pop_front() {
            Some(ev) => std::task::Poll::Ready(Some(Ok(ev))),
            None => std::task::Poll::Pending,
        }
    }
}
