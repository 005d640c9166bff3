//! The public record format of `EtcdDiscovery`: keys, JSON values and their parsing.
//! Pure functions, no I/O: everything a hostile record can reach is tested here.
//!
//! Key: `{prefix}/v1/channels/{ns}/{component}/{topic}/{publisher_id:x}` (segments
//! percent-encoded as in [`ChannelId::to_path`]). Value:
//! `{"id":{"namespace":…,"component":…,"topic":…,"publisher_id":42},
//! "transport":{"kind":"zmq","endpoint":"tcp://10.0.0.5:41234"},
//! "worker":{"worker_id":7,"dp_rank":0}}` (`worker` optional); unknown fields are
//! ignored.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::discovery::model::encode_segment;
use crate::discovery::records::{DynamoRecords, RecordError, check_endpoint};
use crate::discovery::{ChannelId, DiscoveryError, Instance, Query, Transport, WorkerIdentity};
use crate::wire::Dialect;

#[derive(Serialize, Deserialize)]
struct Record<'a> {
    #[serde(borrow)]
    id: RecordId<'a>,
    #[serde(borrow)]
    transport: RecordTransport<'a>,
    /// The worker the publisher speaks for; absent when it registered none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    worker: Option<WorkerIdentity>,
    /// Where the worker serves its recovery log; absent when it registered none.
    #[serde(default, borrow, skip_serializing_if = "Option::is_none")]
    recovery: Option<Cow<'a, str>>,
}

#[derive(Serialize, Deserialize)]
struct RecordId<'a> {
    #[serde(borrow)]
    namespace: Cow<'a, str>,
    #[serde(borrow)]
    component: Cow<'a, str>,
    #[serde(borrow)]
    topic: Cow<'a, str>,
    publisher_id: u64,
}

#[derive(Serialize, Deserialize)]
struct RecordTransport<'a> {
    #[serde(borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow)]
    endpoint: Cow<'a, str>,
}

/// Key layout under one prefix, in one record format.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    /// `{prefix}/v1/channels/`
    root: String,
    dynamo: Option<DynamoRecords>,
}

/// What a registration writes: its key and value, and for Dynamo the
/// `event_sources` record beside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) key: String,
    pub(crate) value: String,
    pub(crate) companion: Option<(String, String)>,
}

impl Keys {
    /// `prefix` must already be validated (non-empty, no trailing `/`).
    pub(crate) fn new(prefix: &str, dialect: Dialect, records: Option<&DynamoRecords>) -> Keys {
        Keys {
            root: format!("{prefix}/v1/channels/"),
            dynamo: match dialect {
                Dialect::Dynamo => Some(records.cloned().unwrap_or_default()),
                Dialect::EventPlane => None,
            },
        }
    }

    /// Every followed key lives under it.
    pub(crate) fn root(&self) -> &str {
        match &self.dynamo {
            Some(d) => d.root(),
            None => &self.root,
        }
    }

    /// What registering `id` at `transport` writes.
    pub(crate) fn entry(
        &self,
        id: &ChannelId,
        transport: &Transport,
        worker: Option<WorkerIdentity>,
        recovery: Option<&str>,
    ) -> Result<Entry, DiscoveryError> {
        match &self.dynamo {
            None => Ok(Entry {
                key: format!("{}{}", self.root, id.to_path()),
                value: encode_value(id, transport, worker, recovery),
                companion: None,
            }),
            Some(d) => {
                // A registration's own worker goes into Dynamo's `event_sources`
                // record, in place of the one the format was configured with.
                let with_worker;
                let d = match worker {
                    Some(w) => {
                        with_worker = d.clone().worker(w.worker_id, w.dp_rank);
                        &with_worker
                    }
                    None => d,
                };
                if let Some(e) = d.registration_error() {
                    return Err(e);
                }
                let key = d.key(id);
                let (value, source) = d.encode(id, transport, recovery);
                let companion = d.source_key(&key).map(|k| (k, source));
                Ok(Entry {
                    key,
                    value,
                    companion,
                })
            }
        }
    }

    /// The key written beside `key`, if any (Dynamo's `event_sources` record).
    pub(crate) fn companion_key(&self, key: &str) -> Option<String> {
        self.dynamo.as_ref().and_then(|d| d.source_key(key))
    }

    /// The narrowest key prefix covering `query` (topic without component is filtered
    /// client-side by [`Query::matches`]). In Dynamo's format, every `event_channels`
    /// and `event_sources` record (of any namespace, filtered here): the sources say
    /// where each publisher's worker is asked for what a router lost.
    pub(crate) fn query_prefix(&self, query: &Query) -> String {
        if self.dynamo.is_some() {
            return DynamoRecords::BOTH_ROOTS.to_owned();
        }
        let mut out = self.root.clone();
        encode_segment(query.namespace_filter(), &mut out);
        out.push('/');
        if let Some(component) = query.component_filter() {
            encode_segment(component, &mut out);
            out.push('/');
            if let Some(topic) = query.topic_filter() {
                encode_segment(topic, &mut out);
                out.push('/');
            }
        }
        out
    }

    /// The id a key names.
    pub(crate) fn id_of(&self, key: &[u8]) -> Result<ChannelId, RecordError> {
        if let Some(d) = &self.dynamo {
            return d.id_of(key).map(|(id, _)| id);
        }
        let rest = key
            .strip_prefix(self.root.as_bytes())
            .ok_or(RecordError::ForeignKey)?;
        let path =
            std::str::from_utf8(rest).map_err(|_| RecordError::BadKey("not UTF-8".to_owned()))?;
        let id = ChannelId::from_path(path).map_err(|e| RecordError::BadKey(e.to_string()))?;
        // One key per id (see the Dynamo format's check).
        if id.to_path() != path {
            return Err(RecordError::BadKey("not in canonical form".to_owned()));
        }
        Ok(id)
    }

    /// In Dynamo's format, the id an `event_sources` key names and, for a put, the
    /// recovery endpoint its value names; `None` for any other key.
    pub(crate) fn source(
        &self,
        key: &[u8],
        value: Option<&[u8]>,
        max_value: usize,
    ) -> Option<Result<(ChannelId, Option<String>), RecordError>> {
        let d = self.dynamo.as_ref()?;
        let id = match d.source_id(key)? {
            Ok(id) => id,
            Err(e) => return Some(Err(e)),
        };
        let Some(value) = value else {
            return Some(Ok((id, None)));
        };
        if value.len() > max_value {
            return Some(Err(RecordError::TooLarge {
                len: value.len(),
                max: max_value,
            }));
        }
        Some(
            d.parse_source(&id, value)
                .map(|(_, recovery)| (id, recovery)),
        )
    }

    /// Parses one key-value pair into an instance; `mod_revision` is its incarnation.
    pub(crate) fn parse(
        &self,
        key: &[u8],
        value: &[u8],
        mod_revision: i64,
        max_value: usize,
    ) -> Result<Option<Instance>, RecordError> {
        let (id, endpoint) = match &self.dynamo {
            Some(d) => match d.id_of(key) {
                Ok((id, endpoint)) => (id, Some(endpoint)),
                // Another endpoint or scope of Dynamo's: not ours to follow, not malformed.
                Err(RecordError::Unfollowed) => return Ok(None),
                Err(e) => return Err(e),
            },
            None => (self.id_of(key)?, None),
        };
        if value.len() > max_value {
            return Err(RecordError::TooLarge {
                len: value.len(),
                max: max_value,
            });
        }
        let incarnation = u64::try_from(mod_revision)
            .ok()
            .filter(|&r| r > 0)
            .ok_or(RecordError::BadRevision(mod_revision))?;
        if let (Some(d), Some(endpoint)) = (&self.dynamo, endpoint) {
            let transport = d.parse_value(&id, &endpoint, value)?;
            return Ok(Some(Instance::new(id, transport, incarnation)));
        }
        let record: Record<'_> =
            serde_json::from_slice(value).map_err(|e| RecordError::BadValue(e.to_string()))?;
        let value_id = ChannelId::new(
            record.id.namespace,
            record.id.component,
            record.id.topic,
            record.id.publisher_id,
        )
        .map_err(|e| RecordError::BadValue(e.to_string()))?;
        if value_id != id {
            return Err(RecordError::IdMismatch);
        }
        if record.transport.kind != "zmq" {
            return Err(RecordError::UnsupportedTransport(
                record.transport.kind.chars().take(32).collect(),
            ));
        }
        if record.transport.endpoint.is_empty() {
            return Err(RecordError::BadValue("empty endpoint".to_owned()));
        }
        check_endpoint(&record.transport.endpoint)?;
        let mut instance = Instance::new(
            id,
            Transport::zmq(record.transport.endpoint.into_owned()),
            incarnation,
        );
        instance.worker = record.worker;
        if let Some(recovery) = record.recovery {
            // A bad one costs the publisher its repairs, not its place in discovery.
            if recovery.starts_with("tcp://") && check_endpoint(&recovery).is_ok() {
                instance.recovery = Some(recovery.into_owned());
            } else {
                tracing::warn!(id = %instance.id, "ignoring a recovery endpoint that is not tcp://host:port");
            }
        }
        Ok(Some(instance))
    }
}

/// The JSON value for a registration in our format.
fn encode_value(
    id: &ChannelId,
    transport: &Transport,
    worker: Option<WorkerIdentity>,
    recovery: Option<&str>,
) -> String {
    let (kind, endpoint) = match transport {
        Transport::Zmq { endpoint } => ("zmq", endpoint.as_str()),
        // Readers refuse it (not `tcp://`): an announced publisher lives on its bus.
        Transport::Announced { endpoint } => ("announced", endpoint.as_str()),
    };
    let record = Record {
        id: RecordId {
            namespace: Cow::Borrowed(id.namespace()),
            component: Cow::Borrowed(id.component()),
            topic: Cow::Borrowed(id.topic()),
            publisher_id: id.publisher_id(),
        },
        transport: RecordTransport {
            kind: Cow::Borrowed(kind),
            endpoint: Cow::Borrowed(endpoint),
        },
        worker,
        recovery: recovery.map(Cow::Borrowed),
    };
    // Serializing strings and integers into a String cannot fail.
    serde_json::to_string(&record).unwrap_or_default()
}

/// The smallest key greater than every key starting with `prefix` (etcd's range end).
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (never for our prefixes): every key from `prefix` on.
    vec![0]
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const MAX: usize = 64 * 1024;

    fn keys() -> Keys {
        Keys::new("/eventplane", Dialect::EventPlane, None)
    }

    #[test]
    fn encodes_the_documented_format() {
        let id = ChannelId::new("ns", "c", "t", 42).unwrap();
        let value = encode_value(&id, &Transport::zmq("tcp://10.0.0.5:41234"), None, None);
        assert_eq!(
            value,
            r#"{"id":{"namespace":"ns","component":"c","topic":"t","publisher_id":42},"transport":{"kind":"zmq","endpoint":"tcp://10.0.0.5:41234"}}"#
        );
        let entry = keys()
            .entry(&id, &Transport::zmq("tcp://10.0.0.5:41234"), None, None)
            .unwrap();
        assert_eq!(entry.key, "/eventplane/v1/channels/ns/c/t/2a");
        assert_eq!(
            (entry.value.as_str(), entry.companion),
            (value.as_str(), None)
        );
        let back = keys()
            .parse(entry.key.as_bytes(), value.as_bytes(), 7, MAX)
            .unwrap();
        assert_eq!(
            back,
            Some(Instance::new(id, Transport::zmq("tcp://10.0.0.5:41234"), 7))
        );
    }

    #[test]
    fn the_worker_identity_travels_in_the_record() {
        let id = ChannelId::new("ns", "c", "t", 42).unwrap();
        let transport = Transport::zmq("tcp://10.0.0.5:41234");
        let entry = keys()
            .entry(&id, &transport, Some(WorkerIdentity::new(7, 2)), None)
            .unwrap();
        assert!(
            entry
                .value
                .ends_with(r#","worker":{"worker_id":7,"dp_rank":2}}"#),
            "{}",
            entry.value
        );
        let back = keys()
            .parse(entry.key.as_bytes(), entry.value.as_bytes(), 9, MAX)
            .unwrap()
            .unwrap();
        assert_eq!(back.worker, Some(WorkerIdentity::new(7, 2)));
        assert_eq!(
            back,
            Instance::new(id, transport, 9).with_worker(WorkerIdentity::new(7, 2))
        );
        // A record without one (every earlier writer) parses with none.
        let plain = br#"{"id":{"namespace":"ns","component":"c","topic":"t","publisher_id":1},"transport":{"kind":"zmq","endpoint":"tcp://h:1"}}"#;
        let i = keys()
            .parse(b"/eventplane/v1/channels/ns/c/t/1", plain, 3, MAX)
            .unwrap()
            .unwrap();
        assert_eq!(i.worker, None);
    }

    #[test]
    fn the_recovery_endpoint_travels_in_the_record_and_is_checked() {
        let id = ChannelId::new("ns", "c", "t", 42).unwrap();
        let transport = Transport::zmq("tcp://10.0.0.5:41234");
        let entry = keys()
            .entry(&id, &transport, None, Some("tcp://10.0.0.5:41235"))
            .unwrap();
        assert!(
            entry
                .value
                .ends_with(r#","recovery":"tcp://10.0.0.5:41235"}"#),
            "{}",
            entry.value
        );
        let back = keys()
            .parse(entry.key.as_bytes(), entry.value.as_bytes(), 9, MAX)
            .unwrap()
            .unwrap();
        assert_eq!(
            back,
            Instance::new(id, transport, 9).with_recovery("tcp://10.0.0.5:41235")
        );
        // A recovery endpoint that is not tcp:// is dropped; the publisher stays.
        let bad = br#"{"id":{"namespace":"ns","component":"c","topic":"t","publisher_id":1},"transport":{"kind":"zmq","endpoint":"tcp://h:1"},"recovery":"http://169.254.169.254/"}"#;
        let i = keys()
            .parse(b"/eventplane/v1/channels/ns/c/t/1", bad, 3, MAX)
            .unwrap()
            .unwrap();
        assert_eq!(i.recovery, None);
    }

    #[test]
    fn a_registrations_worker_goes_into_dynamos_event_source() {
        let records = DynamoRecords::new().endpoint("generate").worker(1, 0);
        let keys = Keys::new("/eventplane", Dialect::Dynamo, Some(&records));
        let id = ChannelId::new("ns", "c", "t", 42).unwrap();
        let transport = Transport::zmq("tcp://10.0.0.5:41234");
        let source = |worker| {
            let entry = keys.entry(&id, &transport, worker, None).unwrap();
            entry.companion.unwrap().1
        };
        assert!(source(None).contains(r#""worker":{"worker_id":1,"dp_rank":0}"#));
        assert!(
            source(Some(WorkerIdentity::new(77, 3)))
                .contains(r#""worker":{"worker_id":77,"dp_rank":3}"#)
        );
        // Without a configured worker, the registration's own is enough.
        let keys = Keys::new(
            "/eventplane",
            Dialect::Dynamo,
            Some(&DynamoRecords::new().endpoint("generate")),
        );
        assert!(keys.entry(&id, &transport, None, None).is_err());
        assert!(
            keys.entry(&id, &transport, Some(WorkerIdentity::new(5, 0)), None)
                .is_ok()
        );
    }

    #[test]
    fn a_malformed_worker_identity_is_a_bad_value() {
        let key = b"/eventplane/v1/channels/ns/c/t/1";
        for worker in [
            r#""seven""#,
            r#"{"worker_id":-1,"dp_rank":0}"#,
            r#"{"worker_id":1,"dp_rank":4294967296}"#,
            r#"{"worker_id":18446744073709551616,"dp_rank":0}"#,
            r#"{"dp_rank":0}"#,
        ] {
            let value = format!(
                r#"{{"id":{{"namespace":"ns","component":"c","topic":"t","publisher_id":1}},"transport":{{"kind":"zmq","endpoint":"tcp://h:1"}},"worker":{worker}}}"#
            );
            let err = keys().parse(key, value.as_bytes(), 3, MAX).unwrap_err();
            assert!(matches!(err, RecordError::BadValue(_)), "{worker}: {err:?}");
        }
    }

    #[test]
    fn foreign_writers_may_add_fields() {
        let value = br#"{"version":2,"id":{"publisher_id":1,"topic":"t","component":"c","namespace":"ns","extra":[1,2]},
            "transport":{"endpoint":"tcp://h:1","kind":"zmq","tls":false},"labels":{"zone":"a"}}"#;
        let i = keys()
            .parse(b"/eventplane/v1/channels/ns/c/t/1", value, 3, MAX)
            .unwrap()
            .unwrap();
        assert_eq!(i.transport.endpoint(), "tcp://h:1");
    }

    #[test]
    fn hostile_records_are_rejected_with_the_named_error() {
        use RecordError as E;
        let k = keys();
        let good = br#"{"id":{"namespace":"ns","component":"c","topic":"t","publisher_id":1},"transport":{"kind":"zmq","endpoint":"tcp://h:1"}}"#;
        let key = b"/eventplane/v1/channels/ns/c/t/1";
        assert!(k.parse(key, good, 1, MAX).is_ok());
        let bad_value = || E::BadValue(String::new());
        let bad_key = || E::BadKey(String::new());
        let record = |id: &str, transport: &str| {
            format!(
                r#"{{"id":{{"namespace":"ns","component":"c","topic":"t","publisher_id":{id}}}{transport}}}"#
            )
            .into_bytes()
        };
        let zmq_x = r#","transport":{"kind":"zmq","endpoint":"x"}"#;
        let cases: Vec<(&[u8], Vec<u8>, i64, E)> = vec![
            (b"/other/ns/c/t/1", good.to_vec(), 1, E::ForeignKey),
            (
                b"/eventplane/v1/channels/ns/c/t",
                good.to_vec(),
                1,
                bad_key(),
            ),
            (
                b"/eventplane/v1/channels/ns/c/t/zz",
                good.to_vec(),
                1,
                bad_key(),
            ),
            (
                b"/eventplane/v1/channels/ns/c/t/\xff",
                good.to_vec(),
                1,
                bad_key(),
            ),
            (
                b"/eventplane/v1/channels/ns/c/t/2",
                good.to_vec(),
                1,
                E::IdMismatch,
            ),
            // Aliases of …/ns/c/t/1: not canonical.
            (
                b"/eventplane/v1/channels/ns/c/t/01",
                good.to_vec(),
                1,
                bad_key(),
            ),
            (
                b"/eventplane/v1/channels/n%73/c/t/1",
                good.to_vec(),
                1,
                bad_key(),
            ),
            (key, good.to_vec(), 0, E::BadRevision(0)),
            (key, good.to_vec(), -5, E::BadRevision(-5)),
            (key, b"".to_vec(), 1, bad_value()),
            (key, b"null".to_vec(), 1, bad_value()),
            (key, b"{\"id\":".to_vec(), 1, bad_value()),
            (
                key,
                vec![b'['; 100_000],
                1,
                E::TooLarge {
                    len: 100_000,
                    max: MAX,
                },
            ),
            (key, vec![b'['; 10_000], 1, bad_value()),
            (key, record("9007199254740992", zmq_x), 1, bad_value()),
            (key, record("-1", zmq_x), 1, bad_value()),
            (key, record("1.5", zmq_x), 1, bad_value()),
            (
                key,
                record("1", r#","transport":{"kind":"nats","endpoint":"x"}"#),
                1,
                E::UnsupportedTransport("nats".to_owned()),
            ),
            (
                key,
                record("1", r#","transport":{"kind":"zmq","endpoint":""}"#),
                1,
                E::BadValue("empty endpoint".to_owned()),
            ),
            (key, record("1", ""), 1, bad_value()),
            // An endpoint over 1 KiB, or a host over 253 bytes: malformed, counted.
            (
                key,
                record(
                    "1",
                    &format!(
                        r#","transport":{{"kind":"zmq","endpoint":"tcp://{}:1"}}"#,
                        "h".repeat(1100)
                    ),
                ),
                1,
                E::EndpointTooLong {
                    len: 1108,
                    max: 1024,
                },
            ),
            (
                key,
                record(
                    "1",
                    &format!(
                        r#","transport":{{"kind":"zmq","endpoint":"tcp://{}:1"}}"#,
                        "h".repeat(254)
                    ),
                ),
                1,
                E::EndpointTooLong {
                    len: 262,
                    max: 1024,
                },
            ),
        ];
        for (key, value, rev, expected) in cases {
            let err = k.parse(key, &value, rev, MAX).unwrap_err();
            let what = (
                String::from_utf8_lossy(key),
                String::from_utf8_lossy(&value[..value.len().min(80)]),
            );
            // Messages from serde and key parsing are checked by variant; every other
            // error by value.
            match (&err, &expected) {
                (E::BadValue(_), E::BadValue(m)) | (E::BadKey(_), E::BadKey(m)) if m.is_empty() => {
                }
                _ => assert_eq!(err, expected, "{what:?}"),
            }
        }
    }

    #[test]
    fn the_value_size_limit_holds_at_its_boundary() {
        let k = keys();
        let key = b"/eventplane/v1/channels/ns/c/t/1";
        let record = br#"{"id":{"namespace":"ns","component":"c","topic":"t","publisher_id":1},"transport":{"kind":"zmq","endpoint":"tcp://h:1"}}"#;
        // Padded with JSON whitespace to exactly MAX bytes: accepted; one more: refused.
        let mut value = record.to_vec();
        value.resize(MAX, b' ');
        assert!(k.parse(key, &value, 1, MAX).is_ok());
        value.push(b' ');
        assert_eq!(
            k.parse(key, &value, 1, MAX),
            Err(RecordError::TooLarge {
                len: MAX + 1,
                max: MAX
            })
        );
    }

    #[test]
    fn query_prefixes_are_exact() {
        let k = keys();
        assert_eq!(
            k.query_prefix(&Query::new("ns")),
            "/eventplane/v1/channels/ns/"
        );
        assert_eq!(
            k.query_prefix(&Query::new("a.b").component("c")),
            "/eventplane/v1/channels/a%2Eb/c/"
        );
        assert_eq!(
            k.query_prefix(&Query::new("ns").component("c").topic("t")),
            "/eventplane/v1/channels/ns/c/t/"
        );
        // Topic without component: the namespace prefix, filtered client-side.
        assert_eq!(
            k.query_prefix(&Query::new("ns").topic("t")),
            "/eventplane/v1/channels/ns/"
        );
    }

    #[test]
    fn prefix_end_increments() {
        assert_eq!(prefix_end(b"/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }
}
