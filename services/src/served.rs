//! kv-relay's recovery endpoint: ours (`kv::pipeline::RecoveryServer`), or Dynamo 1.6.1's KV
//! query endpoint (`kv::dynamo_recovery::DynamoQueryServer`) when it publishes on
//! Dynamo's wire and registers Dynamo's records.

use eventplane::kv::pipeline::{RecoveryServer, SharedWorkerLog};

/// The codec Dynamo's router is asked to use (`request_plane_codec`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RecoveryCodec {
    Msgpack,
    Json,
}

/// A recovery endpoint being served.
pub enum Served {
    Ours(RecoveryServer),
    #[cfg(any(feature = "etcd", feature = "kube"))]
    Dynamo(
        eventplane::kv::dynamo_recovery::DynamoQueryServer,
        RecoveryCodec,
    ),
}

impl Served {
    /// Binds `endpoint` (`tcp://host:port`): Dynamo's endpoint in `dynamo`'s codec, or
    /// ours.
    pub async fn bind(
        endpoint: &str,
        log: SharedWorkerLog,
        dynamo: Option<RecoveryCodec>,
    ) -> Result<Served, String> {
        #[cfg(any(feature = "etcd", feature = "kube"))]
        if let Some(codec) = dynamo {
            use eventplane::kv::dynamo_recovery::{DynamoQueryConfig, DynamoQueryServer};
            return DynamoQueryServer::bind(endpoint, log, DynamoQueryConfig::default())
                .await
                .map(|s| Served::Dynamo(s, codec))
                .map_err(|e| crate::common::chain(&e));
        }
        #[cfg(not(any(feature = "etcd", feature = "kube")))]
        let _ = dynamo;
        RecoveryServer::bind(endpoint, log)
            .await
            .map(Served::Ours)
            .map_err(|e| crate::common::chain(&e))
    }

    /// Ours, when it is.
    pub fn ours(&self) -> Option<&RecoveryServer> {
        match self {
            Served::Ours(s) => Some(s),
            #[cfg(any(feature = "etcd", feature = "kube"))]
            Served::Dynamo(..) => None,
        }
    }

    /// The endpoint as registered: `tcp://host:port` (ours) or
    /// `dynamo+CODEC://host:port` (Dynamo's, the record's `recovery_target`).
    pub fn local_endpoint(&self) -> String {
        match self {
            Served::Ours(s) => s.local_endpoint().to_owned(),
            #[cfg(any(feature = "etcd", feature = "kube"))]
            Served::Dynamo(s, codec) => {
                let scheme = match codec {
                    RecoveryCodec::Msgpack => "dynamo+msgpack",
                    RecoveryCodec::Json => "dynamo+json",
                };
                format!("{scheme}://{}", s.local_addr())
            }
        }
    }

    /// Samples its counters into `exporter` (`eventplane_kv_recovery_*`).
    pub fn export(
        served: &std::sync::Arc<Served>,
        exporter: eventplane::metrics::Exporter,
    ) -> eventplane::metrics::Exporter {
        let served = served.clone();
        match &*served {
            Served::Ours(_) => exporter.source(move || match &*served {
                Served::Ours(s) => s.stats(),
                #[cfg(any(feature = "etcd", feature = "kube"))]
                Served::Dynamo(..) => Default::default(),
            }),
            #[cfg(any(feature = "etcd", feature = "kube"))]
            Served::Dynamo(..) => exporter.source(move || match &*served {
                Served::Dynamo(s, _) => s.stats(),
                Served::Ours(_) => Default::default(),
            }),
        }
    }

    /// Its counters.
    pub fn stats(&self) -> serde_json::Value {
        let stats = match self {
            Served::Ours(s) => serde_json::to_value(s.stats()),
            #[cfg(any(feature = "etcd", feature = "kube"))]
            Served::Dynamo(s, _) => serde_json::to_value(s.stats()),
        };
        stats.unwrap_or_default()
    }
}
