//! The KV-event model. JSON uses snake_case, externally tagged enums.

use serde::{Deserialize, Serialize};

pub use crate::discovery::{DpRank, WorkerId};

/// The engine's hash of a block (it chains the parent's hash).
///
/// ```
/// use eventplane::kv::BlockHash;
/// assert_eq!(serde_json::to_string(&BlockHash(42)).unwrap(), "42");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

/// The hash of one block's tokens, as computed by [`tokens_hash`].
///
/// ```
/// use eventplane::kv::{tokens_hash, TokensHash};
/// let h: TokensHash = tokens_hash(&[1, 2, 3, 4]);
/// assert_eq!(h, tokens_hash(&[1, 2, 3, 4]));
/// assert_ne!(h, tokens_hash(&[1, 2, 3, 5]));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TokensHash(pub u64);

/// Where a block is stored.
///
/// ```
/// use eventplane::kv::StorageTier;
/// assert_eq!(StorageTier::default(), StorageTier::Device);
/// assert_eq!(serde_json::to_string(&StorageTier::HostPinned).unwrap(), r#""host_pinned""#);
/// ```
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum StorageTier {
    /// GPU memory (the default).
    #[default]
    Device,
    /// Pinned host memory.
    HostPinned,
    /// Local disk.
    Disk,
    /// Anything else (remote stores).
    External,
}

/// One stored block.
///
/// ```
/// use eventplane::kv::{tokens_hash, BlockHash, StoredBlock};
/// let block = StoredBlock { block_hash: BlockHash(0xabc), tokens_hash: tokens_hash(&[1; 16]) };
/// assert_eq!(block.block_hash, BlockHash(0xabc));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StoredBlock {
    /// The engine's block hash.
    pub block_hash: BlockHash,
    /// The hash of the block's tokens.
    pub tokens_hash: TokensHash,
}

/// What happened.
///
/// ```
/// use eventplane::kv::{BlockHash, KvEventData};
/// let removed = KvEventData::Removed { block_hashes: vec![BlockHash(7)] };
/// assert_eq!(serde_json::to_string(&removed).unwrap(), r#"{"removed":{"block_hashes":[7]}}"#);
/// assert_eq!(serde_json::to_string(&KvEventData::Cleared).unwrap(), r#""cleared""#);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum KvEventData {
    /// Blocks were stored, extending the chain after `parent_hash`.
    Stored {
        /// The block before the first stored one, if any.
        parent_hash: Option<BlockHash>,
        /// The stored blocks, in chain order.
        blocks: Vec<StoredBlock>,
    },
    /// Blocks were evicted.
    Removed {
        /// The evicted blocks.
        block_hashes: Vec<BlockHash>,
    },
    /// The worker's data-parallel rank (`KvEvent::dp_rank`) holds no blocks, in any
    /// storage tier: a router drops everything it holds for that worker and rank
    /// (Dynamo's router does the same). Engines send it when they reset their cache;
    /// a worker also sends it when it lost track of its engine (a dropped batch, an
    /// engine restart: see [`EngineListener`](super::EngineListener)).
    Cleared,
}

impl KvEventData {
    /// Blocks this event carries (0 for `Cleared`).
    pub fn block_count(&self) -> usize {
        match self {
            KvEventData::Stored { blocks, .. } => blocks.len(),
            KvEventData::Removed { block_hashes } => block_hashes.len(),
            KvEventData::Cleared => 0,
        }
    }
}

/// An event with its id and data-parallel rank.
///
/// ```
/// use eventplane::kv::{BlockHash, KvEvent, KvEventData};
/// let ev = KvEvent { id: 9, dp_rank: 0, data: KvEventData::Removed { block_hashes: vec![BlockHash(1)] } };
/// assert_eq!(ev.data.block_count(), 1);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvEvent {
    /// Raw engine id on input; dense outbound id (from 1) once processed.
    pub id: u64,
    /// The data-parallel rank.
    pub dp_rank: DpRank,
    /// What happened.
    pub data: KvEventData,
}

/// Where an event happened.
///
/// ```
/// use eventplane::kv::{Placement, StorageTier, WorkerId};
/// let at = Placement { worker_id: WorkerId(1), dp_rank: 0, tier: StorageTier::Device };
/// // Events merge and dedup only within one placement.
/// assert_ne!(at, Placement { dp_rank: 1, ..at });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Placement {
    /// The worker.
    pub worker_id: WorkerId,
    /// Its data-parallel rank.
    pub dp_rank: DpRank,
    /// The storage tier.
    pub tier: StorageTier,
}

/// An engine event with its placement: the processor's input.
///
/// ```
/// use eventplane::kv::{KvEvent, KvEventData, Placement, PlacementEvent, StorageTier, WorkerId};
/// let input = PlacementEvent {
///     placement: Placement { worker_id: WorkerId(1), dp_rank: 0, tier: StorageTier::Device },
///     event: KvEvent { id: 17, dp_rank: 0, data: KvEventData::Cleared },
/// };
/// assert_eq!(input.event.id, 17); // the engine's raw id
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PlacementEvent {
    /// Where.
    pub placement: Placement,
    /// What (the id is the engine's raw event id).
    pub event: KvEvent,
}

/// What routers receive.
///
/// ```
/// use eventplane::kv::{KvEvent, KvEventData, RouterEvent, StorageTier, WorkerId};
/// let ev = RouterEvent {
///     worker_id: WorkerId(3),
///     tier: StorageTier::HostPinned,
///     event: KvEvent { id: 1, dp_rank: 0, data: KvEventData::Cleared },
/// };
/// assert_eq!(
///     serde_json::to_string(&ev).unwrap(),
///     r#"{"worker_id":3,"tier":"host_pinned","event":{"id":1,"dp_rank":0,"data":"cleared"}}"#
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RouterEvent {
    /// The worker.
    pub worker_id: WorkerId,
    /// The storage tier.
    pub tier: StorageTier,
    /// The event, with its dense outbound id.
    pub event: KvEvent,
}

/// Seed of [`tokens_hash`] (the value Dynamo's router uses, so hashes interoperate).
pub(crate) const TOKENS_HASH_SEED: u64 = 1337;

/// xxh3-64 with seed 1337 over the tokens as u32 little-endian bytes.
///
/// ```
/// use eventplane::kv::{tokens_hash, TokensHash};
/// assert_eq!(tokens_hash(&[1, 2, 3, 4]), TokensHash(14643705804678351452));
/// ```
pub fn tokens_hash(tokens: &[u32]) -> TokensHash {
    hash_token_ids(tokens.iter().copied())
}

/// [`tokens_hash`] of tokens the engine decoder holds as `u64` (each already checked
/// to fit in a `u32`), without collecting them first.
pub(crate) fn tokens_hash_wide(tokens: &[u64]) -> TokensHash {
    hash_token_ids(tokens.iter().map(|&t| t as u32))
}

fn hash_token_ids(tokens: impl ExactSizeIterator<Item = u32>) -> TokensHash {
    // Blocks of up to 64 tokens (the common block sizes) hash from a small stack
    // buffer, up to 256 from a larger one (zeroing it costs as much as the hash).
    const SMALL: usize = 64;
    const LARGE: usize = 256;
    let n = tokens.len();
    let mut small = [0u8; SMALL * 4];
    let mut large;
    let mut heap;
    let bytes: &mut [u8] = if n <= SMALL {
        small.get_mut(..n * 4).unwrap_or_default()
    } else if n <= LARGE {
        large = [0u8; LARGE * 4];
        large.get_mut(..n * 4).unwrap_or_default()
    } else {
        heap = vec![0u8; n * 4];
        &mut heap
    };
    for (chunk, t) in bytes.chunks_exact_mut(4).zip(tokens) {
        chunk.copy_from_slice(&t.to_le_bytes());
    }
    TokensHash(xxhash_rust::xxh3::xxh3_64_with_seed(
        bytes,
        TOKENS_HASH_SEED,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pinned from an independent implementation (Debian's python3-xxhash:
    /// `xxh3_64_intdigest(struct.pack('<I'*n, *tokens), seed=1337)`).
    #[test]
    fn tokens_hash_vectors() {
        assert_eq!(tokens_hash(&[]), TokensHash(15128690059815094969));
        assert_eq!(tokens_hash(&[1, 2, 3, 4]), TokensHash(14643705804678351452));
        let sixteen: Vec<u32> = (0..16).collect();
        assert_eq!(tokens_hash(&sixteen), TokensHash(15310707395893867146));
        assert_eq!(
            tokens_hash(&[u32::MAX, 0, 128_000]),
            TokensHash(15588869943153351760)
        );
    }

    #[test]
    fn json_shapes() {
        let stored = KvEventData::Stored {
            parent_hash: Some(BlockHash(1)),
            blocks: vec![StoredBlock {
                block_hash: BlockHash(2),
                tokens_hash: TokensHash(3),
            }],
        };
        assert_eq!(
            serde_json::to_string(&stored).unwrap(),
            r#"{"stored":{"parent_hash":1,"blocks":[{"block_hash":2,"tokens_hash":3}]}}"#
        );
        let back: KvEventData =
            serde_json::from_str(&serde_json::to_string(&stored).unwrap()).unwrap();
        assert_eq!(back, stored);
        assert_eq!(
            serde_json::to_string(&StorageTier::Disk).unwrap(),
            r#""disk""#
        );
    }
}
