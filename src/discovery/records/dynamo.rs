//! Dynamo's discovery records, as a Dynamo 1.6.1 worker writes them.
//! Pure functions, no I/O.
//!
//! - `v1/event_channels/namespace/{ns}/component/{c}/endpoint/{e}/topic/{t}/{id:x}`:
//!   `{"type":"EventChannel","scope":{"kind":"endpoint","endpoint":{"namespace","component","name"}},
//!   "topic","instance_id","transport":{"kind":"Zmq","config":{"endpoint"}}}` — what a
//!   subscriber follows.
//! - `v1/event_sources/…` with the same tail:
//!   `{"type":"EventSource","scope":…,"topic","publisher_id","metadata":{"kv_state_endpoint":{…},
//!   "worker":{"worker_id","dp_rank"},"publisher_id","recovery_target"?}}` — written
//!   beside it, under the same lease; read for its worker and recovery target.
//!
//! Keys carry no prefix before `v1/`; segments are percent-encoded as in
//! [`ChannelId::to_path`]. Only endpoint scopes are followed (the scope kind Dynamo's
//! KV event publishers use); a record of another scope kind is skipped and counted.

// Each backend uses its own part (etcd: keys and values; Kubernetes: values and the
// resource form).
#![cfg_attr(not(all(feature = "etcd", feature = "kube")), allow(dead_code))]

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use super::RecordError;
use crate::ConfigError;
use crate::discovery::model::{decode_segment, encode_segment};
use crate::discovery::{ChannelId, DiscoveryError, DpRank, Transport, WorkerId, WorkerIdentity};

const CHANNELS: &str = "v1/event_channels/";
const SOURCES: &str = "v1/event_sources/";

/// Records in Dynamo's layout: for `EtcdDiscovery` in
/// [`Dialect::Dynamo`](crate::wire::Dialect::Dynamo) and for `KubeDiscovery`.
///
/// - Watching needs nothing: without an endpoint it follows every endpoint of the
///   query's namespace (and component); with one, only that endpoint.
/// - Registering needs the endpoint and the worker (its `worker_id` and `dp_rank` go
///   into the `event_sources` record that Dynamo's router reads).
///
/// ```
/// use eventplane::discovery::DynamoRecords;
/// let worker_side = DynamoRecords::new().endpoint("generate").worker(77, 0);
/// let router_side = DynamoRecords::new(); // every endpoint
/// assert_ne!(worker_side, router_side);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DynamoRecords {
    pub(crate) endpoint: Option<String>,
    pub(crate) worker: Option<(u64, u32)>,
}

impl DynamoRecords {
    /// Every endpoint, no worker (enough to watch).
    pub fn new() -> DynamoRecords {
        DynamoRecords::default()
    }

    /// The Dynamo endpoint (`scope.endpoint.name`, e.g. `generate`) registrations are
    /// written under and watches are narrowed to.
    pub fn endpoint(mut self, endpoint: impl Into<String>) -> DynamoRecords {
        self.endpoint = Some(endpoint.into());
        self
    }

    /// The worker whose events registrations publish (`metadata.worker`).
    pub fn worker(mut self, worker_id: impl Into<WorkerId>, dp_rank: DpRank) -> DynamoRecords {
        self.worker = Some((worker_id.into().0, dp_rank));
        self
    }

    /// Why this cannot register, if it cannot.
    pub(crate) fn registration_error(&self) -> Option<DiscoveryError> {
        let reason = match (&self.endpoint, &self.worker) {
            (None, _) => "Dynamo records need an endpoint to register (DynamoRecords::endpoint)",
            (_, None) => "Dynamo records need a worker to register (DynamoRecords::worker)",
            _ => return None,
        };
        Some(DiscoveryError::InvalidConfig(ConfigError::Invalid {
            field: "records",
            reason: reason.to_owned(),
        }))
    }

    /// The `event_channels` root: every followed key lives under it.
    pub(crate) fn root(&self) -> &'static str {
        CHANNELS
    }

    /// The prefix of both roots (`event_channels` and `event_sources`): what an etcd
    /// watch reads to learn each publisher's recovery target with its channel.
    pub(crate) const BOTH_ROOTS: &'static str = "v1/event_";

    /// The id an `event_sources` key names (`None` for another key, or another
    /// endpoint than the configured one).
    pub(crate) fn source_id(&self, key: &[u8]) -> Option<Result<ChannelId, RecordError>> {
        let rest = key.strip_prefix(SOURCES.as_bytes())?;
        match self.id_of_tail(rest) {
            Ok((id, _)) => Some(Ok(id)),
            Err(RecordError::Unfollowed) => None,
            Err(e) => Some(Err(e)),
        }
    }

    fn tail(&self, id: &ChannelId, endpoint: &str) -> String {
        let mut out = String::with_capacity(64);
        for (label, seg) in [
            ("namespace", id.namespace()),
            ("component", id.component()),
            ("endpoint", endpoint),
            ("topic", id.topic()),
        ] {
            out.push_str(label);
            out.push('/');
            encode_segment(seg, &mut out);
            out.push('/');
        }
        out.push_str(&format!("{:x}", id.publisher_id()));
        out
    }

    /// The `event_channels` key of `id` (the endpoint must be set).
    pub(crate) fn key(&self, id: &ChannelId) -> String {
        format!(
            "{CHANNELS}{}",
            self.tail(id, self.endpoint.as_deref().unwrap_or_default())
        )
    }

    /// The `event_sources` key beside a channel key.
    pub(crate) fn source_key(&self, channel_key: &str) -> Option<String> {
        channel_key
            .strip_prefix(CHANNELS)
            .map(|tail| format!("{SOURCES}{tail}"))
    }

    /// The id and endpoint a channel key names; `Unfollowed` for another endpoint
    /// than the configured one.
    pub(crate) fn id_of(&self, key: &[u8]) -> Result<(ChannelId, String), RecordError> {
        let rest = key
            .strip_prefix(CHANNELS.as_bytes())
            .ok_or(RecordError::ForeignKey)?;
        self.id_of_tail(rest)
    }

    /// As [`id_of`](Self::id_of) for a key without its `v1/event_channels/` root: the
    /// form of the keys of a `DynamoWorkerMetadata` resource's `event_channels` and
    /// `event_sources` maps.
    pub(crate) fn id_of_tail(&self, rest: &[u8]) -> Result<(ChannelId, String), RecordError> {
        let path =
            std::str::from_utf8(rest).map_err(|_| RecordError::BadKey("not UTF-8".to_owned()))?;
        let bad = |why: &str| RecordError::BadKey(why.to_owned());
        let segs: Vec<&str> = path.splitn(10, '/').collect();
        let [
            "namespace",
            ns,
            "component",
            component,
            "endpoint",
            endpoint,
            "topic",
            topic,
            id,
        ] = segs[..]
        else {
            // Channels of a namespace or component scope are well-formed Dynamo keys
            // that this backend does not follow: not malformed.
            if matches!(
                segs[..],
                ["namespace", _, "topic", _, _] | ["namespace", _, "component", _, "topic", _, _]
            ) {
                return Err(RecordError::Unfollowed);
            }
            return Err(bad(
                "not namespace/{ns}/component/{c}/endpoint/{e}/topic/{t}/{id}",
            ));
        };
        let decode = |s: &str| decode_segment(s).map_err(|e| RecordError::BadKey(e.to_string()));
        let endpoint = decode(endpoint)?;
        if self.endpoint.as_ref().is_some_and(|e| *e != endpoint) {
            return Err(RecordError::Unfollowed);
        }
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad("instance id is not hex"));
        }
        let publisher_id =
            u64::from_str_radix(id, 16).map_err(|_| bad("instance id out of range"))?;
        let id = ChannelId::new(
            decode(ns)?,
            decode(component)?,
            decode(topic)?,
            publisher_id,
        )
        .map_err(|e| RecordError::BadKey(e.to_string()))?;
        // One key per id: `%61` for `a`, upper-case or zero-padded hex would name the
        // same publisher under a second key, whose deletion would stop the first.
        if rest != self.tail(&id, &endpoint).as_bytes() {
            return Err(bad("not in canonical form"));
        }
        Ok((id, endpoint))
    }

    /// Parses an `EventChannel` value against the key's id and endpoint.
    pub(crate) fn parse_value(
        &self,
        id: &ChannelId,
        endpoint: &str,
        value: &[u8],
    ) -> Result<Transport, RecordError> {
        let record: Channel<'_> =
            serde_json::from_slice(value).map_err(|e| RecordError::BadValue(e.to_string()))?;
        if record.kind != "EventChannel" {
            return Err(RecordError::BadValue(format!(
                "type {:?} is not EventChannel",
                record.kind.chars().take(32).collect::<String>()
            )));
        }
        if record.scope.kind != "endpoint" {
            return Err(RecordError::UnsupportedScope(
                record.scope.kind.chars().take(32).collect(),
            ));
        }
        let Some(scope) = record.scope.endpoint else {
            return Err(RecordError::BadValue(
                "endpoint scope without endpoint".to_owned(),
            ));
        };
        if scope.namespace != id.namespace()
            || scope.component != id.component()
            || scope.name != endpoint
            || record.topic != id.topic()
            || record.instance_id != id.publisher_id()
        {
            return Err(RecordError::IdMismatch);
        }
        if record.transport.kind != "Zmq" {
            return Err(RecordError::UnsupportedTransport(
                record.transport.kind.chars().take(32).collect(),
            ));
        }
        match record.transport.config.and_then(|c| c.endpoint) {
            Some(e) if !e.is_empty() => {
                super::endpoint::check_endpoint(&e)?;
                Ok(Transport::zmq(e.into_owned()))
            }
            _ => Err(RecordError::BadValue("empty endpoint".to_owned())),
        }
    }

    /// Parses an `EventSource` value (the record Dynamo's router reads a publisher's
    /// worker from) against the key's id: the worker it names, and the worker's
    /// recovery endpoint when it names one: `metadata.eventplane_recovery` (ours), else
    /// `metadata.recovery_target` (Dynamo's, as `dynamo+CODEC://HOST:PORT/PATH`). One
    /// that is unusable is dropped with a warning, the worker kept.
    pub(crate) fn parse_source(
        &self,
        id: &ChannelId,
        value: &[u8],
    ) -> Result<(WorkerIdentity, Option<String>), RecordError> {
        let record: SourceIn<'_> =
            serde_json::from_slice(value).map_err(|e| RecordError::BadValue(e.to_string()))?;
        if record.kind != "EventSource" {
            return Err(RecordError::BadValue("type is not EventSource".to_owned()));
        }
        if record.publisher_id != id.publisher_id() || record.topic != id.topic() {
            return Err(RecordError::IdMismatch);
        }
        let worker = record.metadata.worker;
        let ours = record.metadata.eventplane_recovery.and_then(|r| {
            if r.starts_with("tcp://") && super::endpoint::check_endpoint(&r).is_ok() {
                Some(r.into_owned())
            } else {
                tracing::warn!(%id, "ignoring a recovery endpoint that is not tcp://host:port");
                None
            }
        });
        // Ours when both are there; else Dynamo's worker recovery endpoint.
        let recovery = ours.or_else(|| {
            let target = record
                .metadata
                .recovery_target
                .filter(|t| t.get() != "null")?;
            let target: serde_json::Value = serde_json::from_str(target.get())
                .inspect_err(|_| tracing::warn!(%id, "ignoring an unreadable recovery_target"))
                .ok()?;
            super::dynamo_target::target_in(&target, worker.worker_id, worker.dp_rank)
                .inspect_err(|why| tracing::warn!(%id, why, "ignoring a recovery_target"))
                .ok()
        });
        Ok((
            WorkerIdentity::new(worker.worker_id, worker.dp_rank),
            recovery,
        ))
    }

    /// The `EventChannel` and `EventSource` values of a registration (endpoint and
    /// worker must be set), as etcd holds them.
    /// The `EventSource` carries the worker's `recovery` endpoint when it has one:
    /// a Dynamo one (`dynamo+CODEC://HOST:PORT`) as `metadata.recovery_target`, which
    /// Dynamo's router asks, ours as `metadata.eventplane_recovery`.
    pub(crate) fn encode(
        &self,
        id: &ChannelId,
        transport: &Transport,
        recovery: Option<&str>,
    ) -> (String, String) {
        self.encode_as(id, transport, false, recovery)
    }

    /// As [`encode`](Self::encode), in the form of a `DynamoWorkerMetadata`
    /// resource: each `EventChannel` also carries Dynamo's legacy trailing
    /// `namespace` and `component` fields, and the `EventSource` the worker's
    /// `recovery` endpoint when it has one (as in [`encode`](Self::encode)).
    pub(crate) fn encode_for_resource(
        &self,
        id: &ChannelId,
        transport: &Transport,
        recovery: Option<&str>,
    ) -> (String, String) {
        self.encode_as(id, transport, true, recovery)
    }

    fn encode_as(
        &self,
        id: &ChannelId,
        transport: &Transport,
        legacy: bool,
        recovery: Option<&str>,
    ) -> (String, String) {
        let endpoint = self.endpoint.as_deref().unwrap_or_default();
        let (worker_id, dp_rank) = self.worker.unwrap_or_default();
        let scope_endpoint = ScopeEndpoint {
            namespace: Cow::Borrowed(id.namespace()),
            component: Cow::Borrowed(id.component()),
            name: Cow::Borrowed(endpoint),
        };
        let scope = Scope {
            kind: Cow::Borrowed("endpoint"),
            endpoint: Some(scope_endpoint.clone()),
        };
        // An announced publisher's name is not `tcp://`: readers refuse the record.
        let zmq = transport.endpoint();
        let channel = Channel {
            kind: Cow::Borrowed("EventChannel"),
            scope: scope.clone(),
            topic: Cow::Borrowed(id.topic()),
            instance_id: id.publisher_id(),
            transport: ChannelTransport {
                kind: Cow::Borrowed("Zmq"),
                config: Some(ZmqConfig {
                    endpoint: Some(Cow::Borrowed(zmq)),
                }),
            },
            namespace: legacy.then_some(Cow::Borrowed(id.namespace())),
            component: legacy.then_some(Cow::Borrowed(id.component())),
        };
        let source = Source {
            kind: "EventSource",
            scope,
            topic: id.topic(),
            publisher_id: id.publisher_id(),
            metadata: SourceMetadata {
                kv_state_endpoint: scope_endpoint,
                worker: Worker { worker_id, dp_rank },
                publisher_id: id.publisher_id(),
                eventplane_recovery: recovery.filter(|r| !r.starts_with("dynamo+")),
                recovery_target: recovery.and_then(|r| super::dynamo_target::target_out(id, r)),
            },
        };
        // Serializing strings and integers into a String cannot fail.
        (
            serde_json::to_string(&channel).unwrap_or_default(),
            serde_json::to_string(&source).unwrap_or_default(),
        )
    }
}

#[derive(Serialize, Deserialize)]
struct Channel<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow)]
    scope: Scope<'a>,
    #[serde(borrow)]
    topic: Cow<'a, str>,
    instance_id: u64,
    #[serde(borrow)]
    transport: ChannelTransport<'a>,
    /// Dynamo's legacy fields, written after the others in a resource's records.
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    namespace: Option<Cow<'a, str>>,
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    component: Option<Cow<'a, str>>,
}

#[derive(Clone, Serialize, Deserialize)]
struct Scope<'a> {
    #[serde(borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    endpoint: Option<ScopeEndpoint<'a>>,
}

#[derive(Clone, Serialize, Deserialize)]
struct ScopeEndpoint<'a> {
    #[serde(borrow)]
    namespace: Cow<'a, str>,
    #[serde(borrow)]
    component: Cow<'a, str>,
    #[serde(borrow)]
    name: Cow<'a, str>,
}

#[derive(Serialize, Deserialize)]
struct ChannelTransport<'a> {
    #[serde(borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    config: Option<ZmqConfig<'a>>,
}

#[derive(Serialize, Deserialize)]
struct ZmqConfig<'a> {
    #[serde(borrow, default)]
    endpoint: Option<Cow<'a, str>>,
}

#[derive(Serialize)]
struct Source<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    scope: Scope<'a>,
    topic: &'a str,
    publisher_id: u64,
    metadata: SourceMetadata<'a>,
}

#[derive(Serialize)]
struct SourceMetadata<'a> {
    kv_state_endpoint: ScopeEndpoint<'a>,
    worker: Worker,
    publisher_id: u64,
    /// Where the worker serves its recovery log (ours: `kv::pipeline::RecoveryServer`).
    #[serde(skip_serializing_if = "Option::is_none")]
    eventplane_recovery: Option<&'a str>,
    /// Where it serves Dynamo's KV queries (`kv::dynamo_recovery::DynamoQueryServer`).
    #[serde(skip_serializing_if = "Option::is_none")]
    recovery_target: Option<super::dynamo_target::TargetOut<'a>>,
}

#[derive(Deserialize)]
struct SourceIn<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow)]
    topic: Cow<'a, str>,
    publisher_id: u64,
    #[serde(borrow)]
    metadata: SourceMetadataIn<'a>,
}

#[derive(Deserialize)]
struct SourceMetadataIn<'a> {
    worker: Worker,
    #[serde(borrow, default)]
    eventplane_recovery: Option<Cow<'a, str>>,
    /// Read apart (kept as text: its depth is never counted here), so that a
    /// malformed one costs the repairs, not the worker.
    #[serde(borrow, default)]
    recovery_target: Option<&'a serde_json::value::RawValue>,
}

#[derive(Serialize, Deserialize)]
struct Worker {
    worker_id: u64,
    dp_rank: u32,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn records() -> DynamoRecords {
        DynamoRecords::new().endpoint("generate").worker(77, 0)
    }

    #[test]
    fn keys_and_prefixes() {
        let id = ChannelId::new("ns.with/slash", "c", "kv-events", 0xabc).unwrap();
        let key = records().key(&id);
        assert_eq!(
            key,
            "v1/event_channels/namespace/ns%2Ewith%2Fslash/component/c/endpoint/generate/topic/kv-events/abc"
        );
        assert_eq!(
            records().source_key(&key).unwrap(),
            "v1/event_sources/namespace/ns%2Ewith%2Fslash/component/c/endpoint/generate/topic/kv-events/abc"
        );
        assert_eq!(
            records().id_of(key.as_bytes()).unwrap(),
            (id, "generate".to_owned())
        );
    }

    #[test]
    fn hostile_keys_get_the_named_error() {
        use RecordError as E;
        let r = records();
        let bad = |k: &str| r.id_of(k.as_bytes()).unwrap_err();
        let root = "v1/event_channels/";
        assert_eq!(bad("v1/event_sources/namespace/a"), E::ForeignKey);
        for k in [
            "namespace/ns/component/c/endpoint/generate/topic/t",
            "namespace/ns/component/c/endpoint/generate/topic/t/1/extra",
            "namespace/ns/component/c/endpoint/generate/topik/t/1",
            "namespace/ns/component/c/endpoint/generate/topic/t/zz",
            "namespace/ns/component/c/endpoint/generate/topic/t/",
            "namespace/n%2/component/c/endpoint/generate/topic/t/1",
            "namespace/ns/component/c/endpoint/generate/topic/t/20000000000000",
            "namespace/ns/component/c/endpoint/generate/topic/t/10000000000000000",
            // Aliases of …/t/1 and …/t/abc: not canonical.
            "namespace/ns/component/c/endpoint/generate/topic/t/01",
            "namespace/ns/component/c/endpoint/generate/topic/t/ABC",
            "namespace/n%73/component/c/endpoint/generate/topic/t/1",
            "namespace/ns/component/c/endpoint/generate/topic/t%2d/1",
        ] {
            assert!(matches!(bad(&format!("{root}{k}")), E::BadKey(_)), "{k}");
        }
        assert_eq!(
            bad("v1/event_channels/namespace/ns/component/c/endpoint/other/topic/t/1"),
            E::Unfollowed
        );
        // Other scopes: well-formed, not followed, not malformed.
        assert_eq!(
            bad("v1/event_channels/namespace/ns/topic/t/1"),
            E::Unfollowed
        );
        assert_eq!(
            bad("v1/event_channels/namespace/ns/component/c/topic/t/1"),
            E::Unfollowed
        );
        // 2^53 - 1 is the largest id.
        assert!(
            r.id_of(b"v1/event_channels/namespace/ns/component/c/endpoint/generate/topic/t/1fffffffffffff")
                .is_ok()
        );
    }

    #[test]
    fn hostile_values_get_the_named_error() {
        use RecordError as E;
        let r = records();
        let id = ChannelId::new("ns", "c", "t", 1).unwrap();
        let value = |scope: &str, topic: &str, iid: &str, transport: &str| {
            format!(
                r#"{{"type":"EventChannel","scope":{scope},"topic":"{topic}","instance_id":{iid},"transport":{transport}}}"#
            )
        };
        let scope = r#"{"kind":"endpoint","endpoint":{"namespace":"ns","component":"c","name":"generate"}}"#;
        let zmq = r#"{"kind":"Zmq","config":{"endpoint":"tcp://h:1"}}"#;
        let good = value(scope, "t", "1", zmq);
        assert_eq!(
            r.parse_value(&id, "generate", good.as_bytes()).unwrap(),
            Transport::zmq("tcp://h:1")
        );
        let other_scope = scope.replace("\"ns\"", "\"ns2\"");
        let cases = [
            (good.replace("EventChannel", "EventSource"), "bad"),
            (
                value(r#"{"kind":"namespace","namespace":"ns"}"#, "t", "1", zmq),
                "scope",
            ),
            (value(r#"{"kind":"endpoint"}"#, "t", "1", zmq), "bad"),
            (value(&other_scope, "t", "1", zmq), "id"),
            (value(scope, "t2", "1", zmq), "id"),
            (value(scope, "t", "2", zmq), "id"),
            (value(scope, "t", "-1", zmq), "bad"),
            (
                value(
                    scope,
                    "t",
                    "1",
                    r#"{"kind":"Nats","config":{"subject":"x"}}"#,
                ),
                "transport",
            ),
            (
                value(
                    scope,
                    "t",
                    "1",
                    r#"{"kind":"Zmq","config":{"endpoint":""}}"#,
                ),
                "bad",
            ),
            (value(scope, "t", "1", r#"{"kind":"Zmq"}"#), "bad"),
            ("[]".to_owned(), "bad"),
            // An endpoint over 1 KiB: malformed, as in our format.
            (
                value(
                    scope,
                    "t",
                    "1",
                    &format!(
                        r#"{{"kind":"Zmq","config":{{"endpoint":"tcp://{}:1"}}}}"#,
                        "h".repeat(1100)
                    ),
                ),
                "long",
            ),
        ];
        for (v, want) in cases {
            let err = r.parse_value(&id, "generate", v.as_bytes()).unwrap_err();
            let ok = match want {
                "bad" => matches!(err, E::BadValue(_)),
                "scope" => err == E::UnsupportedScope("namespace".to_owned()),
                "id" => err == E::IdMismatch,
                "long" => matches!(err, E::EndpointTooLong { len: 1108, .. }),
                _ => err == E::UnsupportedTransport("Nats".to_owned()),
            };
            assert!(ok, "{v}: {err:?}");
        }
        // Unknown fields, anywhere: ignored.
        let extra = good
            .replace(r#""topic""#, r#""labels":{"a":[1]},"topic""#)
            .replace(r#""kind":"Zmq","#, r#""kind":"Zmq","tls":true,"#);
        assert!(r.parse_value(&id, "generate", extra.as_bytes()).is_ok());
    }

    #[test]
    fn registering_needs_an_endpoint_and_a_worker() {
        assert!(DynamoRecords::new().registration_error().is_some());
        assert!(
            DynamoRecords::new()
                .endpoint("e")
                .registration_error()
                .is_some()
        );
        assert!(
            DynamoRecords::new()
                .worker(1, 0)
                .registration_error()
                .is_some()
        );
        assert!(records().registration_error().is_none());
    }
}
