//! Router events' `data` as both schemas write it (ours and Dynamo's), for the
//! encoders in `sink` and `dynamo`.

use super::KvEventData;
use crate::msgpack::{TooLong, put};
use crate::wire::Dialect;

/// Writes a [`KvEventData`] as serde's derive writes it: `{"stored": {parent_hash,
/// blocks: [{block_hash, tokens_hash}]}}`, `{"removed": {block_hashes}}` or
/// `"cleared"`, with Dynamo's extra fields (`start_position` on a store, `mm_extra_info` on each
/// block, both `nil` here) for [`Dialect::Dynamo`].
pub(super) fn put_event_data(
    out: &mut Vec<u8>,
    data: &KvEventData,
    dialect: Dialect,
) -> Result<(), TooLong> {
    let dynamo = dialect == Dialect::Dynamo;
    match data {
        KvEventData::Stored {
            parent_hash,
            blocks,
        } => {
            out.extend_from_slice(if dynamo {
                b"\x81\xa6stored\x83\xabparent_hash"
            } else {
                b"\x81\xa6stored\x82\xabparent_hash"
            });
            match parent_hash {
                Some(h) => put::uint(out, h.0),
                None => put::nil(out),
            }
            if dynamo {
                out.extend_from_slice(b"\xaestart_position\xc0");
            }
            out.extend_from_slice(b"\xa6blocks");
            put::array_len(out, blocks.len())?;
            for b in blocks {
                out.extend_from_slice(if dynamo {
                    b"\x83\xaablock_hash"
                } else {
                    b"\x82\xaablock_hash"
                });
                put::uint(out, b.block_hash.0);
                out.extend_from_slice(b"\xabtokens_hash");
                put::uint(out, b.tokens_hash.0);
                if dynamo {
                    out.extend_from_slice(b"\xadmm_extra_info\xc0");
                }
            }
        }
        KvEventData::Removed { block_hashes } => {
            out.extend_from_slice(b"\x81\xa7removed\x81\xacblock_hashes");
            put::array_len(out, block_hashes.len())?;
            for h in block_hashes {
                put::uint(out, h.0);
            }
        }
        KvEventData::Cleared => out.extend_from_slice(b"\xa7cleared"),
    }
    Ok(())
}
