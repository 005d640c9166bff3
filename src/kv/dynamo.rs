//! Router events in Dynamo's schema: the payload of a Dynamo `kv-events`
//! envelope is a msgpack list of
//! `{worker_id, storage_tier, residency_domain, event: {event_id, data, dp_rank}}`,
//! `data` being `{"stored": {parent_hash, start_position, blocks: [{block_hash,
//! tokens_hash, mm_extra_info}]}}`, `{"removed": {block_hashes}}` or `"cleared"`.
//!
//! What we keep and what we drop, both ways:
//! - `storage_tier` ↔ [`StorageTier`]: `device`, `host_pinned`, `disk`, `external`.
//!   A tier this version does not know decodes as [`StorageTier::External`] (held
//!   somewhere off the worker), not as an error.
//! - `event_id` ↔ [`KvEvent::id`]; `dp_rank` ↔ [`KvEvent::dp_rank`] (0 when absent).
//! - `residency_domain` is written `"worker"` and ignored on decode.
//! - `start_position` and `mm_extra_info` are written `nil` (our engines' events carry
//!   neither) and ignored on decode.
//! - Unknown fields, anywhere, are ignored: Dynamo adds fields between releases.

use std::borrow::Cow;

use serde::Deserialize;

use super::schema::put_event_data;
use super::{
    BlockHash, KvEvent, KvEventData, RouterEvent, StorageTier, StoredBlock, TokensHash, WorkerId,
};
use super::{EncodeError, KvDecodeError};
use crate::msgpack::put;

/// Encodes router events as a Dynamo `kv-events` payload, byte for byte what a Dynamo
/// 1.6.1 worker writes for the same events.
pub(super) fn encode_dynamo(events: &[RouterEvent]) -> Result<Vec<u8>, EncodeError> {
    let err = |e| EncodeError::new("Dynamo router events", e);
    // Written field by field, in the order and forms serde's derive would give
    // (checked against it by a test), without building the schema's structs.
    let mut out = Vec::with_capacity(events.len().saturating_mul(160));
    put::array_len(&mut out, events.len()).map_err(err)?;
    for e in events {
        out.extend_from_slice(b"\x84\xa9worker_id");
        put::uint(&mut out, e.worker_id.0);
        out.extend_from_slice(b"\xacstorage_tier");
        put::str(&mut out, tier_name(e.tier));
        out.extend_from_slice(b"\xb0residency_domain\xa6worker\xa5event\x83\xa8event_id");
        put::uint(&mut out, e.event.id);
        out.extend_from_slice(b"\xa4data");
        put_event_data(&mut out, &e.event.data, crate::wire::Dialect::Dynamo).map_err(err)?;
        out.extend_from_slice(b"\xa7dp_rank");
        put::uint(&mut out, u64::from(e.event.dp_rank));
    }
    Ok(out)
}

/// Decodes a Dynamo `kv-events` payload into router events. Never panics on hostile
/// input; unknown fields are ignored; an unknown event kind fails the payload.
pub(super) fn decode_dynamo(payload: &[u8]) -> Result<Vec<RouterEvent>, KvDecodeError> {
    KvDecodeError::check_shape(payload)?;
    let wire: Vec<InEvent<'_>> =
        rmp_serde::from_slice(payload).map_err(|e| KvDecodeError(Box::new(e)))?;
    Ok(wire.into_iter().map(RouterEvent::from).collect())
}

/// Dynamo's name for a tier (serde's snake case of [`StorageTier`], which ours
/// shares).
pub(super) fn tier_name(tier: StorageTier) -> &'static str {
    match tier {
        StorageTier::Device => "device",
        StorageTier::HostPinned => "host_pinned",
        StorageTier::Disk => "disk",
        StorageTier::External => "external",
    }
}

fn tier_from_dynamo(name: &str) -> StorageTier {
    match name {
        "device" => StorageTier::Device,
        "host_pinned" => StorageTier::HostPinned,
        "disk" => StorageTier::Disk,
        _ => StorageTier::External,
    }
}

#[derive(Deserialize)]
pub(crate) struct InEvent<'a> {
    worker_id: u64,
    #[serde(borrow, default)]
    storage_tier: Option<Cow<'a, str>>,
    event: InKv,
}

#[derive(Deserialize)]
struct InKv {
    event_id: u64,
    #[serde(default)]
    dp_rank: u32,
    data: InData,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum InData {
    Stored {
        #[serde(default)]
        parent_hash: Option<u64>,
        blocks: Vec<InBlock>,
    },
    Removed {
        block_hashes: Vec<u64>,
    },
    Cleared,
}

#[derive(Deserialize)]
struct InBlock {
    block_hash: u64,
    tokens_hash: u64,
}

impl From<InEvent<'_>> for RouterEvent {
    fn from(e: InEvent<'_>) -> RouterEvent {
        let data = match e.event.data {
            InData::Stored {
                parent_hash,
                blocks,
            } => KvEventData::Stored {
                parent_hash: parent_hash.map(BlockHash),
                blocks: blocks
                    .into_iter()
                    .map(|b| StoredBlock {
                        block_hash: BlockHash(b.block_hash),
                        tokens_hash: TokensHash(b.tokens_hash),
                    })
                    .collect(),
            },
            InData::Removed { block_hashes } => KvEventData::Removed {
                block_hashes: block_hashes.into_iter().map(BlockHash).collect(),
            },
            InData::Cleared => KvEventData::Cleared,
        };
        RouterEvent {
            worker_id: WorkerId(e.worker_id),
            tier: e
                .storage_tier
                .as_deref()
                .map_or(StorageTier::Device, tier_from_dynamo),
            event: KvEvent {
                id: e.event.event_id,
                dp_rank: e.event.dp_rank,
                data,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::wire::Dialect;
    use serde::ser::SerializeSeq;
    use serde::{Serialize, Serializer};

    // The schema as serde structs: the reference the direct encoder is checked against.
    #[derive(Serialize)]
    struct OutEvent<'a> {
        worker_id: u64,
        storage_tier: &'static str,
        residency_domain: &'static str,
        event: OutKv<'a>,
    }

    #[derive(Serialize)]
    struct OutKv<'a> {
        event_id: u64,
        data: OutData<'a>,
        dp_rank: u32,
    }

    #[derive(Serialize)]
    #[serde(rename_all = "snake_case")]
    enum OutData<'a> {
        Stored {
            parent_hash: Option<u64>,
            start_position: Option<u64>,
            blocks: OutBlocks<'a>,
        },
        Removed {
            block_hashes: &'a [BlockHash],
        },
        Cleared,
    }

    /// Serializes stored blocks in Dynamo's shape without building them first.
    struct OutBlocks<'a>(&'a [StoredBlock]);

    #[derive(Serialize)]
    struct OutBlock {
        block_hash: u64,
        tokens_hash: u64,
        mm_extra_info: Option<()>,
    }

    impl Serialize for OutBlocks<'_> {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let mut seq = serializer.serialize_seq(Some(self.0.len()))?;
            for b in self.0 {
                seq.serialize_element(&OutBlock {
                    block_hash: b.block_hash.0,
                    tokens_hash: b.tokens_hash.0,
                    mm_extra_info: None,
                })?;
            }
            seq.end()
        }
    }

    impl<'a> From<&'a RouterEvent> for OutEvent<'a> {
        fn from(e: &'a RouterEvent) -> OutEvent<'a> {
            let data = match &e.event.data {
                KvEventData::Stored {
                    parent_hash,
                    blocks,
                } => OutData::Stored {
                    parent_hash: parent_hash.map(|h| h.0),
                    start_position: None,
                    blocks: OutBlocks(blocks),
                },
                KvEventData::Removed { block_hashes } => OutData::Removed { block_hashes },
                KvEventData::Cleared => OutData::Cleared,
            };
            OutEvent {
                worker_id: e.worker_id.0,
                storage_tier: tier_name(e.tier),
                residency_domain: "worker",
                event: OutKv {
                    event_id: e.event.id,
                    data,
                    dp_rank: e.event.dp_rank,
                },
            }
        }
    }

    #[test]
    fn every_tier_and_kind_round_trips() {
        let events = crate::kv::tests::every_tier_and_kind();
        let payload = Dialect::Dynamo.encode_router_events(&events).unwrap();
        assert_eq!(
            Dialect::Dynamo.decode_router_events(&payload).unwrap(),
            events
        );
        // Byte for byte what serde's derive of the schema writes.
        let wire: Vec<OutEvent<'_>> = events.iter().map(OutEvent::from).collect();
        assert_eq!(payload, rmp_serde::to_vec_named(&wire).unwrap());
    }

    #[test]
    fn unknown_tiers_and_kinds() {
        // An unknown tier is kept as External; an unknown kind fails the payload.
        let tier = b"\x91\x83\xa9worker_id\x01\xacstorage_tier\xa4tape\xa5event\x82\xa8event_id\x05\xa4data\xa7cleared";
        assert_eq!(
            Dialect::Dynamo.decode_router_events(tier).unwrap()[0].tier,
            StorageTier::External
        );
        let kind = b"\x91\x83\xa9worker_id\x01\xacstorage_tier\xa6device\xa5event\x82\xa8event_id\x05\xa4data\xa7renamed";
        assert!(Dialect::Dynamo.decode_router_events(kind).is_err());
    }
}
