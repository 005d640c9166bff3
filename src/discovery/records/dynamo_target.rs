//! The `metadata.recovery_target` of Dynamo's `event_sources` record: where a
//! worker's KV query endpoint listens (Dynamo 1.6.1's worker recovery), and its
//! spelling in [`Instance::recovery`](crate::discovery::Instance::recovery).
//!
//! ```json
//! "recovery_target": {"component": "c", "endpoint": "worker_kv_query_source_1f",
//!   "namespace": "ns", "instance_id": 31,
//!   "transport": {"tcp": "10.0.0.7:41000/1f/ns/c/worker_kv_query_source_1f"},
//!   "device_type": "cuda", "request_plane_codec": "msgpack"}
//! ```
//!
//! In an [`Instance`](crate::discovery::Instance) read back, such a target is the
//! string `dynamo+msgpack://HOST:PORT/PATH?worker_id=W&dp_rank=R` (or
//! `dynamo+json://…`): `transport.tcp` behind the codec's scheme, and the worker the
//! record names. A worker registers `dynamo+msgpack://HOST:PORT`; the record gets the
//! rest from the registration's id.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use super::endpoint::{MAX_ENDPOINT_LEN, check_endpoint};
use crate::discovery::ChannelId;

/// The schemes of a Dynamo recovery target in [`Instance::recovery`], by codec.
///
/// [`Instance::recovery`]: crate::discovery::Instance::recovery
pub(crate) const SCHEMES: [(&str, &str); 2] =
    [("dynamo+msgpack://", "msgpack"), ("dynamo+json://", "json")];

/// The Dynamo endpoint name of a publisher's KV query endpoint (Dynamo's own
/// workers name it after their publisher id).
fn endpoint_name(publisher_id: u64) -> String {
    format!("worker_kv_query_source_{publisher_id:x}")
}

#[derive(Serialize)]
pub(super) struct TargetOut<'a> {
    component: &'a str,
    endpoint: String,
    namespace: &'a str,
    instance_id: u64,
    transport: Tcp<'a>,
    device_type: &'static str,
    request_plane_codec: &'static str,
}

#[derive(Serialize, Deserialize)]
struct Tcp<'a> {
    #[serde(borrow)]
    tcp: Cow<'a, str>,
}

#[derive(Deserialize)]
struct TargetIn<'a> {
    #[serde(borrow)]
    transport: Tcp<'a>,
    #[serde(borrow, default)]
    request_plane_codec: Option<Cow<'a, str>>,
}

/// The record form of a registration's recovery endpoint when it is a Dynamo one
/// (`dynamo+CODEC://HOST:PORT`, any path ignored); `None` for ours.
pub(super) fn target_out<'a>(id: &'a ChannelId, recovery: &str) -> Option<TargetOut<'a>> {
    let (codec, rest) = SCHEMES
        .iter()
        .find_map(|(scheme, codec)| recovery.strip_prefix(scheme).map(|r| (*codec, r)))?;
    let address = rest.split_once('/').map_or(rest, |(a, _)| a);
    let endpoint = endpoint_name(id.publisher_id());
    let tcp = format!(
        "{address}/{:x}/{}/{}/{endpoint}",
        id.publisher_id(),
        id.namespace(),
        id.component()
    );
    Some(TargetOut {
        component: id.component(),
        endpoint,
        namespace: id.namespace(),
        instance_id: id.publisher_id(),
        transport: Tcp {
            tcp: Cow::Owned(tcp),
        },
        device_type: "cuda",
        request_plane_codec: codec,
    })
}

/// A `recovery_target` as [`Instance::recovery`] spells it, or why it is unusable
/// (the worker is then kept, without repairs).
///
/// [`Instance::recovery`]: crate::discovery::Instance::recovery
pub(super) fn target_in(
    value: &serde_json::Value,
    worker_id: u64,
    dp_rank: u32,
) -> Result<String, &'static str> {
    let target = TargetIn::deserialize(value).map_err(|_| "not a Dynamo Instance")?;
    // Dynamo writes no codec when its request plane is msgpack's default.
    let codec = target.request_plane_codec.as_deref().unwrap_or("msgpack");
    let scheme = SCHEMES
        .iter()
        .find(|(_, c)| *c == codec)
        .map(|(s, _)| *s)
        .ok_or("a request plane codec other than msgpack or json")?;
    let tcp = target.transport.tcp;
    let (address, path) = tcp.split_once('/').ok_or("transport.tcp without a path")?;
    // No query or fragment of its own: the spelling appends one.
    let clean = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_graphic() && b != b'?' && b != b'#')
    };
    if !clean(address) || !clean(path) || !address.contains(':') {
        return Err("transport.tcp is not HOST:PORT/PATH");
    }
    let spelled = format!("{scheme}{tcp}?worker_id={worker_id}&dp_rank={dp_rank}");
    if spelled.len() > MAX_ENDPOINT_LEN || check_endpoint(&format!("tcp://{address}")).is_err() {
        return Err("transport.tcp too long");
    }
    Ok(spelled)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_target_round_trips_through_its_record_form() {
        let id = ChannelId::new("capns", "kvworker", "kv-events", 0x1abc).unwrap();
        let out = target_out(&id, "dynamo+json://127.0.0.1:4100").unwrap();
        let value = serde_json::to_value(&out).unwrap();
        assert_eq!(
            value,
            serde_json::json!({
                "component": "kvworker", "endpoint": "worker_kv_query_source_1abc",
                "namespace": "capns", "instance_id": 0x1abc,
                "transport": {"tcp": "127.0.0.1:4100/1abc/capns/kvworker/worker_kv_query_source_1abc"},
                "device_type": "cuda", "request_plane_codec": "json"
            })
        );
        assert_eq!(
            target_in(&value, 7, 1).unwrap(),
            "dynamo+json://127.0.0.1:4100/1abc/capns/kvworker/worker_kv_query_source_1abc?worker_id=7&dp_rank=1"
        );
        assert!(target_out(&id, "tcp://127.0.0.1:4100").is_none());
    }

    #[test]
    fn the_captured_target_and_hostile_ones() {
        // As Dynamo 1.6.1's router read it (fixtures/dynamo-1.6.1-recovery), with an
        // instance id past 2^53 as a real worker's.
        let captured = serde_json::json!({"component": "kvworker",
            "endpoint": "worker_kv_query_source_1abcdef12345", "namespace": "capns",
            "instance_id": 4_111_120_441_228_689_670_u64,
            "transport": {"tcp": "127.0.0.1:39729/5151515151/capns/kvworker/worker_kv_query_source_1abcdef12345"},
            "device_type": "cuda", "request_plane_codec": "msgpack"});
        assert_eq!(
            target_in(&captured, 88, 0).unwrap(),
            "dynamo+msgpack://127.0.0.1:39729/5151515151/capns/kvworker/worker_kv_query_source_1abcdef12345?worker_id=88&dp_rank=0"
        );
        let with = |tcp: &str, codec: &str| serde_json::json!({"transport": {"tcp": tcp}, "request_plane_codec": codec});
        assert!(target_in(&with("h:1/p", "msgpack"), 1, 0).is_ok());
        for bad in [
            with("h:1/p", "bincode"),
            with("h:1", "msgpack"),
            with("/p", "msgpack"),
            with("h/p", "msgpack"),
            with("h:1/a b", "msgpack"),
            with(&format!("{}:1/p", "h".repeat(300)), "json"),
            with(&format!("h:1/{}", "p".repeat(1100)), "json"),
            serde_json::json!({"transport": {"nats": "x"}}),
            serde_json::json!("h:1/p"),
        ] {
            assert!(target_in(&bad, 1, 0).is_err(), "{bad}");
        }
    }
}
