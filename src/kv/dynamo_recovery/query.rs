//! What Dynamo 1.6.1's router asks a worker's KV query endpoint, and what it is
//! answered (sans-IO), in both request-plane codecs: msgpack (field-named maps, unit
//! variants as strings) and JSON.

use crate::wire::Dialect;
use serde::{Deserialize, Serialize};

use super::super::dynamo::InEvent;
use crate::kv::{RouterEvent, WorkerId};
use crate::msgpack::put;

/// The codec of a request-plane body (`request_plane_codec` in the worker's
/// `recovery_target`, `payload_codec` in a request).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Codec {
    /// MessagePack, maps with field names (Dynamo's default).
    #[default]
    Msgpack,
    /// JSON.
    Json,
}

/// Why a body or header was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QueryError {
    /// Not what it should be, in its codec.
    #[error("undecodable {what}: {detail}")]
    Undecodable {
        /// What was being read.
        what: &'static str,
        /// Why, in the codec's words.
        detail: String,
    },
    /// Could not be written.
    #[error("cannot encode {0}")]
    Encode(&'static str),
}

fn undecodable(what: &'static str) -> impl FnOnce(String) -> QueryError {
    move |detail| QueryError::Undecodable { what, detail }
}

/// The JSON header of a request's two-part payload: who asks, how the answer comes
/// back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Control {
    /// The request's id (a UUID; the answer's `context` repeats it).
    pub id: String,
    /// `"single_in"` for a KV query.
    pub request_type: String,
    /// `"many_out"` for a KV query.
    pub response_type: String,
    /// The body's codec.
    pub payload_codec: Codec,
    /// Where the answer goes.
    pub connection_info: ConnectionInfo,
}

/// How a request's answer comes back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ConnectionInfo {
    /// `"tcp_server"`: the worker dials the router.
    pub transport: String,
    /// A [`CallHome`], as a JSON string.
    pub info: String,
}

/// Where and as what the worker sends its answer: it dials `address` and opens the
/// stream with `subject`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CallHome {
    /// `HOST:PORT` of the router's response listener.
    pub address: String,
    /// Names the answer's stream (a UUID the router made for this request).
    pub subject: String,
    /// The request's id.
    pub context: String,
    /// `"response"`.
    pub stream_type: String,
}

impl CallHome {
    /// The answer to the query named `subject` goes to `address`.
    pub fn new(address: std::net::SocketAddr, subject: &str) -> CallHome {
        CallHome {
            address: address.to_string(),
            subject: subject.to_owned(),
            context: subject.to_owned(),
            stream_type: "response".to_owned(),
        }
    }
}

impl Control {
    /// A KV query's header: answered as a stream of one answer, on a connection the
    /// worker opens to `call_home.address`.
    pub fn kv_query(id: &str, codec: Codec, call_home: &CallHome) -> Control {
        Control {
            id: id.to_owned(),
            request_type: "single_in".to_owned(),
            response_type: "many_out".to_owned(),
            payload_codec: codec,
            connection_info: ConnectionInfo {
                transport: "tcp_server".to_owned(),
                // A struct of strings always serializes.
                info: serde_json::to_string(call_home).unwrap_or_default(),
            },
        }
    }

    /// Reads a request's header.
    pub fn decode(header: &[u8]) -> Result<Control, QueryError> {
        serde_json::from_slice(header).map_err(|e| undecodable("request header")(e.to_string()))
    }

    /// Writes it.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Where its answer goes.
    pub fn call_home(&self) -> Result<CallHome, QueryError> {
        serde_json::from_str(&self.connection_info.info)
            .map_err(|e| undecodable("connection info")(e.to_string()))
    }
}

/// A router's question to a worker's KV query endpoint (Dynamo's
/// `WorkerKvQueryRequest`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct KvQuery {
    /// The worker asked about.
    pub worker_id: WorkerId,
    /// Its data-parallel rank.
    #[serde(default)]
    pub dp_rank: u32,
    /// The first event wanted (inclusive); `None`: a dump of every block.
    pub start_event_id: Option<u64>,
    /// The last event wanted (inclusive); `None`: through the newest.
    pub end_event_id: Option<u64>,
    /// The router understands a `TreeDumpFailed` answer.
    #[serde(default)]
    pub supports_tree_dump_failed: bool,
    /// `"recovery"` (1.6.1's routers send nothing else).
    #[serde(default = "recovery")]
    pub kind: String,
}

fn recovery() -> String {
    "recovery".to_owned()
}

impl KvQuery {
    /// A recovery query for (`worker_id`, `dp_rank`) from `start` on (`None`: a dump),
    /// as Dynamo 1.6.1's router writes it.
    pub fn recovery(worker_id: impl Into<WorkerId>, dp_rank: u32, start: Option<u64>) -> KvQuery {
        KvQuery {
            worker_id: worker_id.into(),
            dp_rank,
            start_event_id: start,
            end_event_id: None,
            supports_tree_dump_failed: true,
            kind: recovery(),
        }
    }

    /// Writes it in `codec`.
    pub fn encode(&self, codec: Codec) -> Result<Vec<u8>, QueryError> {
        match codec {
            Codec::Msgpack => {
                rmp_serde::to_vec_named(self).map_err(|_| QueryError::Encode("a KV query"))
            }
            Codec::Json => serde_json::to_vec(self).map_err(|_| QueryError::Encode("a KV query")),
        }
    }

    /// Reads one in `codec`.
    pub fn decode(body: &[u8], codec: Codec) -> Result<KvQuery, QueryError> {
        let err = undecodable("KV query");
        match codec {
            Codec::Msgpack => {
                crate::msgpack::check_shape(body).map_err(|e| err(format!("{e:?}")))?;
                rmp_serde::from_slice(body).map_err(|e| undecodable("KV query")(e.to_string()))
            }
            Codec::Json => serde_json::from_slice(body).map_err(|e| err(e.to_string())),
        }
    }
}

/// A worker's answer to a [`KvQuery`] (Dynamo's `WorkerKvQueryResponse`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvAnswer {
    /// The events asked for, through the newest the worker keeps, with their ids.
    Events {
        /// The events.
        events: Vec<RouterEvent>,
        /// The id to go on from.
        last_event_id: u64,
    },
    /// Every block the worker holds, as `Stored` events (id 0, a chain each): it
    /// replaces what the router holds of the rank.
    TreeDump {
        /// The chains.
        events: Vec<RouterEvent>,
        /// The newest event id the dump includes.
        last_event_id: u64,
    },
    /// The worker could not build a dump.
    TreeDumpFailed {
        /// Its newest event id.
        last_event_id: u64,
        /// Why.
        message: String,
    },
    /// The range asked for starts past the newest event the worker has.
    TooNew {
        /// The start asked for.
        requested_start: Option<u64>,
        /// The end asked for.
        requested_end: Option<u64>,
        /// The worker's newest event id.
        newest_available: u64,
    },
    /// The range asked for ends before it starts.
    InvalidRange {
        /// Its start.
        start_id: u64,
        /// Its end.
        end_id: u64,
    },
    /// The query failed on the worker.
    Error(String),
}

impl KvAnswer {
    /// Its kind, event count and ids, for logs.
    pub fn summary(&self) -> String {
        let ids = |e: &[RouterEvent]| {
            let first = e.first().map_or(0, |e| e.event.id);
            let last = e.last().map_or(0, |e| e.event.id);
            format!("{} events ({first}..={last})", e.len())
        };
        match self {
            KvAnswer::Events {
                events,
                last_event_id,
            } => format!("Events: {}, last {last_event_id}", ids(events)),
            KvAnswer::TreeDump {
                events,
                last_event_id,
            } => format!("TreeDump: {} chains, last {last_event_id}", events.len()),
            other => format!("{other:?}").chars().take(128).collect(),
        }
    }
}

/// An answer as it comes in, events still in Dynamo's schema.
#[derive(Deserialize)]
enum InAnswer<'a> {
    Events {
        #[serde(borrow)]
        events: Vec<InEvent<'a>>,
        last_event_id: u64,
    },
    TreeDump {
        #[serde(borrow)]
        events: Vec<InEvent<'a>>,
        last_event_id: u64,
    },
    TreeDumpFailed {
        last_event_id: u64,
        #[serde(default)]
        message: String,
    },
    TooNew {
        #[serde(default)]
        requested_start: Option<u64>,
        #[serde(default)]
        requested_end: Option<u64>,
        newest_available: u64,
    },
    InvalidRange {
        start_id: u64,
        end_id: u64,
    },
    Error(String),
}

/// A body of the answer stream: `{"data": answer, "complete_final": false}`, then
/// `{"complete_final": true}`.
#[derive(Deserialize)]
struct InBody<'a> {
    #[serde(borrow, default)]
    data: Option<InAnswer<'a>>,
    #[serde(default)]
    complete_final: bool,
}

/// A body of the answer stream.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AnswerBody {
    /// The answer.
    Answer(KvAnswer),
    /// The stream is complete.
    Final,
}

impl AnswerBody {
    /// Reads one body in `codec`.
    pub fn decode(body: &[u8], codec: Codec) -> Result<AnswerBody, QueryError> {
        let err = undecodable("answer");
        let parsed: InBody<'_> = match codec {
            Codec::Msgpack => {
                crate::msgpack::check_shape(body)
                    .map_err(|e| undecodable("answer")(format!("{e:?}")))?;
                rmp_serde::from_slice(body).map_err(|e| err(e.to_string()))?
            }
            Codec::Json => serde_json::from_slice(body).map_err(|e| err(e.to_string()))?,
        };
        let events = |v: Vec<InEvent<'_>>| v.into_iter().map(RouterEvent::from).collect();
        Ok(match (parsed.data, parsed.complete_final) {
            (None, true) => AnswerBody::Final,
            (None, false) => {
                return Err(QueryError::Undecodable {
                    what: "answer",
                    detail: "a body with neither data nor complete_final".to_owned(),
                });
            }
            (Some(a), _) => AnswerBody::Answer(match a {
                InAnswer::Events {
                    events: e,
                    last_event_id,
                } => KvAnswer::Events {
                    events: events(e),
                    last_event_id,
                },
                InAnswer::TreeDump {
                    events: e,
                    last_event_id,
                } => KvAnswer::TreeDump {
                    events: events(e),
                    last_event_id,
                },
                InAnswer::TreeDumpFailed {
                    last_event_id,
                    message,
                } => KvAnswer::TreeDumpFailed {
                    last_event_id,
                    message,
                },
                InAnswer::TooNew {
                    requested_start,
                    requested_end,
                    newest_available,
                } => KvAnswer::TooNew {
                    requested_start,
                    requested_end,
                    newest_available,
                },
                InAnswer::InvalidRange { start_id, end_id } => {
                    KvAnswer::InvalidRange { start_id, end_id }
                }
                InAnswer::Error(text) => KvAnswer::Error(text),
            }),
        })
    }

    /// Writes it in `codec`, as a Dynamo 1.6.1 worker does.
    pub fn encode(&self, codec: Codec) -> Result<Vec<u8>, QueryError> {
        let msgpack = self.encode_msgpack()?;
        match codec {
            Codec::Msgpack => Ok(msgpack),
            // The same structure: JSON is written from the msgpack (maps of named
            // fields, integers, strings and nils translate one for one).
            Codec::Json => {
                let value: serde_json::Value =
                    rmp_serde::from_slice(&msgpack).map_err(|_| QueryError::Encode("an answer"))?;
                serde_json::to_vec(&value).map_err(|_| QueryError::Encode("an answer"))
            }
        }
    }

    fn encode_msgpack(&self) -> Result<Vec<u8>, QueryError> {
        let answer = match self {
            AnswerBody::Final => return Ok(b"\x81\xaecomplete_final\xc3".to_vec()),
            AnswerBody::Answer(a) => a,
        };
        let mut out = b"\x82\xa4data\x81".to_vec();
        let events = |out: &mut Vec<u8>, events: &[RouterEvent]| {
            out.extend_from_slice(b"\xa6events");
            let list = Dialect::Dynamo
                .encode_router_events(events)
                .map_err(|_| QueryError::Encode("an answer's events"))?;
            out.extend_from_slice(&list);
            Ok::<(), QueryError>(())
        };
        let opt = |out: &mut Vec<u8>, v: Option<u64>| match v {
            Some(v) => put::uint(out, v),
            None => out.push(0xc0),
        };
        match answer {
            KvAnswer::Events {
                events: e,
                last_event_id,
            } => {
                out.extend_from_slice(b"\xa6Events\x82");
                events(&mut out, e)?;
                out.extend_from_slice(b"\xadlast_event_id");
                put::uint(&mut out, *last_event_id);
            }
            KvAnswer::TreeDump {
                events: e,
                last_event_id,
            } => {
                out.extend_from_slice(b"\xa8TreeDump\x83");
                events(&mut out, e)?;
                out.extend_from_slice(b"\xadlast_event_id");
                put::uint(&mut out, *last_event_id);
                out.extend_from_slice(b"\xabreset_scope\xa3all");
            }
            KvAnswer::TreeDumpFailed {
                last_event_id,
                message,
            } => {
                out.extend_from_slice(b"\xaeTreeDumpFailed\x82\xadlast_event_id");
                put::uint(&mut out, *last_event_id);
                out.extend_from_slice(b"\xa7message");
                put::str(&mut out, message);
            }
            KvAnswer::TooNew {
                requested_start,
                requested_end,
                newest_available,
            } => {
                out.extend_from_slice(b"\xa6TooNew\x83\xafrequested_start");
                opt(&mut out, *requested_start);
                out.extend_from_slice(b"\xadrequested_end");
                opt(&mut out, *requested_end);
                out.extend_from_slice(b"\xb0newest_available");
                put::uint(&mut out, *newest_available);
            }
            KvAnswer::InvalidRange { start_id, end_id } => {
                out.extend_from_slice(b"\xacInvalidRange\x82\xa8start_id");
                put::uint(&mut out, *start_id);
                out.extend_from_slice(b"\xa6end_id");
                put::uint(&mut out, *end_id);
            }
            KvAnswer::Error(text) => {
                out.extend_from_slice(b"\xa5Error");
                put::str(&mut out, text);
            }
        }
        out.extend_from_slice(b"\xaecomplete_final\xc2");
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;
    use crate::kv::{
        BlockHash, KvEvent, KvEventData, StorageTier, StoredBlock, TokensHash, WorkerId,
    };

    /// The body Dynamo 1.6.1's router sent at activation (`router-queries.jsonl`,
    /// probe `fw2`): worker 88, rank 0, no start (a dump).
    const ACTIVATION: &str = "86a9776f726b65725f696458a764705f72616e6b00ae73746172745f6576656e745f6964c0ac656e645f6576656e745f6964c0b9737570706f7274735f747265655f64756d705f6661696c6564c3a46b696e64a87265636f76657279";

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn queries_are_written_byte_for_byte_as_dynamo_writes_them() {
        let captured = unhex(ACTIVATION);
        let q = KvQuery::decode(&captured, Codec::Msgpack).unwrap();
        assert_eq!(q, KvQuery::recovery(88, 0, None));
        assert_eq!(q.encode(Codec::Msgpack).unwrap(), captured);
        let gap = KvQuery::recovery(88, 0, Some(5));
        let json = gap.encode(Codec::Json).unwrap();
        assert_eq!(
            std::str::from_utf8(&json).unwrap(),
            r#"{"worker_id":88,"dp_rank":0,"start_event_id":5,"end_event_id":null,"supports_tree_dump_failed":true,"kind":"recovery"}"#
        );
        assert_eq!(KvQuery::decode(&json, Codec::Json).unwrap(), gap);
        // An older client's query: no rank, no opt-in, no kind.
        let old = KvQuery::decode(
            br#"{"worker_id":1,"start_event_id":null,"end_event_id":null}"#,
            Codec::Json,
        )
        .unwrap();
        assert_eq!(
            (
                old.dp_rank,
                old.supports_tree_dump_failed,
                old.kind.as_str()
            ),
            (0, false, "recovery")
        );
    }

    #[test]
    fn a_request_header_names_where_the_answer_goes() {
        let header = r#"{"id":"ee9a","request_type":"single_in","response_type":"many_out","payload_codec":"msgpack","connection_info":{"transport":"tcp_server","info":"{\"address\":\"192.0.2.2:33137\",\"subject\":\"9c07\",\"context\":\"ee9a\",\"stream_type\":\"response\"}"}}"#;
        let control = Control::decode(header.as_bytes()).unwrap();
        assert_eq!(control.payload_codec, Codec::Msgpack);
        let home = control.call_home().unwrap();
        assert_eq!(
            (home.address.as_str(), home.subject.as_str()),
            ("192.0.2.2:33137", "9c07")
        );
        let again = Control::kv_query("ee9a", Codec::Msgpack, &home);
        assert_eq!(again, control);
        assert_eq!(Control::decode(&again.encode()).unwrap(), control);
    }

    fn chain() -> RouterEvent {
        RouterEvent {
            worker_id: WorkerId(88),
            tier: StorageTier::Device,
            event: KvEvent {
                id: 0,
                dp_rank: 0,
                data: KvEventData::Stored {
                    parent_hash: None,
                    blocks: (1..=3)
                        .map(|h| StoredBlock {
                            block_hash: BlockHash(h),
                            tokens_hash: TokensHash(h << 8),
                        })
                        .collect(),
                },
            },
        }
    }

    #[test]
    fn every_answer_round_trips_in_both_codecs() {
        let answers = [
            KvAnswer::Events {
                events: vec![chain()],
                last_event_id: 9,
            },
            KvAnswer::TreeDump {
                events: vec![chain(), chain()],
                last_event_id: u64::MAX,
            },
            KvAnswer::TreeDumpFailed {
                last_event_id: 3,
                message: "busy".into(),
            },
            KvAnswer::TooNew {
                requested_start: Some(7),
                requested_end: None,
                newest_available: 5,
            },
            KvAnswer::InvalidRange {
                start_id: 9,
                end_id: 2,
            },
            KvAnswer::Error("no such rank".into()),
        ];
        for codec in [Codec::Msgpack, Codec::Json] {
            for a in &answers {
                let body = AnswerBody::Answer(a.clone());
                let bytes = body.encode(codec).unwrap();
                assert_eq!(
                    AnswerBody::decode(&bytes, codec).unwrap(),
                    body,
                    "{codec:?}"
                );
            }
            let last = AnswerBody::Final.encode(codec).unwrap();
            assert_eq!(AnswerBody::decode(&last, codec).unwrap(), AnswerBody::Final);
        }
        // The shapes serde gives Dynamo's types (JSON objects are read by name: their
        // keys come out sorted here).
        let value = |bytes: &[u8]| serde_json::from_slice::<serde_json::Value>(bytes).unwrap();
        let json = AnswerBody::Answer(answers[3].clone())
            .encode(Codec::Json)
            .unwrap();
        assert_eq!(
            value(&json),
            value(br#"{"data":{"TooNew":{"requested_start":7,"requested_end":null,"newest_available":5}},"complete_final":false}"#)
        );
        let json = AnswerBody::Answer(answers[5].clone())
            .encode(Codec::Json)
            .unwrap();
        assert_eq!(
            value(&json),
            value(br#"{"data":{"Error":"no such rank"},"complete_final":false}"#)
        );
    }

    #[test]
    fn hostile_bodies_are_refused() {
        for bad in [
            &b"\xdd\xff\xff\xff\xff"[..],
            b"\x81\xa4data\x81\xa7Unknown\xc0",
            b"\x80",
            b"",
        ] {
            assert!(AnswerBody::decode(bad, Codec::Msgpack).is_err(), "{bad:?}");
        }
        for bad in [
            &br#"{"data":{"Events":{"events":[1],"last_event_id":1}}}"#[..],
            b"[",
            br#"{"complete_final":false}"#,
        ] {
            assert!(AnswerBody::decode(bad, Codec::Json).is_err());
        }
        assert!(KvQuery::decode(b"\xdd\xff\xff\xff\xff", Codec::Msgpack).is_err());
    }
}
