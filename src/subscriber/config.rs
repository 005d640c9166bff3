//! Configuration of the dynamic subscriber.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use crate::config::{self, ConfigError};
use crate::discovery::{Discovery, Query};
use crate::lossy::{DropPolicy, MergeConfig};
use crate::net::AddrFilter;
use crate::wire::Layout;
use crate::zmtp;

/// Everything a [`DynamicSubscriber`](super::DynamicSubscriber) needs; built by
/// [`DynamicSubscriberBuilder`](super::DynamicSubscriberBuilder), whose setters
/// document every default.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) discovery: Arc<dyn Discovery>,
    pub(crate) query: Query,
    pub(crate) topic: Option<Bytes>,
    pub(crate) layout: Layout,
    pub(crate) merge: MergeConfig,
    pub(crate) zmtp: zmtp::Config,
    pub(crate) addr_filter: AddrFilter,
    pub(crate) reconnect_min: Duration,
    pub(crate) reconnect_max: Duration,
    pub(crate) healthy_after: Duration,
    pub(crate) rewatch_min: Duration,
    pub(crate) rewatch_max: Duration,
    pub(crate) recv_batch: usize,
    pub(crate) max_publishers: usize,
    pub(crate) max_concurrent_dials: usize,
    pub(crate) notices: usize,
    pub(crate) expect_worker_identity: bool,
    pub(crate) cancel: CancellationToken,
    /// Publishers of namespaces the bus grants are reached through its brokers.
    #[cfg(feature = "tunnel")]
    pub(crate) bus: Option<crate::tunnel::EventBus>,
    /// A granted namespace is dialled directly while no broker covers it.
    #[cfg(feature = "tunnel")]
    pub(crate) tunnel_direct_fallback: bool,
}

impl Config {
    pub(crate) fn new(discovery: Arc<dyn Discovery>, query: Query) -> Config {
        Config {
            discovery,
            query,
            topic: None,
            layout: Layout::default(),
            merge: MergeConfig::default().policy(DropPolicy::DropNewest),
            zmtp: zmtp::Config::default(),
            addr_filter: AddrFilter::default(),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
            healthy_after: Duration::from_secs(30),
            rewatch_min: Duration::from_millis(250),
            rewatch_max: Duration::from_secs(5),
            recv_batch: 256,
            max_publishers: 4096,
            max_concurrent_dials: 256,
            notices: 0,
            expect_worker_identity: false,
            cancel: CancellationToken::new(),
            #[cfg(feature = "tunnel")]
            bus: None,
            #[cfg(feature = "tunnel")]
            tunnel_direct_fallback: false,
        }
    }

    /// The first refused value, named as its builder setter.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        config::backoff_range("reconnect_backoff", self.reconnect_min, self.reconnect_max)?;
        config::backoff_range("rewatch_backoff", self.rewatch_min, self.rewatch_max)?;
        config::nonzero("recv_batch", self.recv_batch)?;
        config::nonzero("max_publishers", self.max_publishers)?;
        config::nonzero("max_concurrent_dials", self.max_concurrent_dials)?;
        Ok(())
    }
}
