//! A fast keyed hasher for tables keyed by engine block hashes.
//!
//! The standard library's SipHash-1-3 cost the KV worker about an eighth of its CPU
//! (the dedup table is touched for every block). Block hashes are already well mixed
//! 64-bit values, but they come from outside, so the table must not let a sender pick
//! colliding keys cheaply: each process draws a random seed once, and each word is
//! mixed with it by a folded 64 × 64 → 128-bit multiply (the high and low halves
//! xored), which spreads every input bit over the low bits the table indexes by.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

/// An odd constant with well-spread bits (the fractional part of π).
const MULTIPLIER: u64 = 0x243f_6a88_85a3_08d3;

fn process_seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| RandomState::new().hash_one(0x9e37_79b9_7f4a_7c15_u64) | 1)
}

fn fold_mul(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

/// Builds [`FastHasher`]s keyed with the process's seed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FastHash {
    seed: u64,
}

impl Default for FastHash {
    fn default() -> Self {
        FastHash {
            seed: process_seed(),
        }
    }
}

impl BuildHasher for FastHash {
    type Hasher = FastHasher;

    fn build_hasher(&self) -> FastHasher {
        FastHasher { state: self.seed }
    }
}

/// Folds each written word into its state with one multiply.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FastHasher {
    state: u64,
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word.get_mut(..chunk.len())
                .unwrap_or_default()
                .copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word) ^ chunk.len() as u64);
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.state = fold_mul(self.state ^ n, MULTIPLIER);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        // One more round, so the last word written reaches every bit too.
        fold_mul(self.state, MULTIPLIER ^ self.state.rotate_left(32))
    }
}

/// A `HashMap` with [`FastHash`].
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, FastHash>;
/// A `HashSet` with [`FastHash`].
pub(crate) type FastSet<T> = std::collections::HashSet<T, FastHash>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_that_differ_in_one_bit_spread_over_low_bits() {
        let build = FastHash::default();
        // Sequential keys and keys differing only in high bits land in distinct
        // low-bit buckets for the most part.
        for step in [1u64, 1 << 20, 1 << 40, 1 << 54] {
            let buckets: std::collections::HashSet<u64> = (0..1024u64)
                .map(|i| build.hash_one(i.wrapping_mul(step)) & 1023)
                .collect();
            assert!(
                buckets.len() > 500,
                "step {step}: {} buckets",
                buckets.len()
            );
        }
    }

    #[test]
    fn the_seed_changes_the_hash() {
        let a = FastHash { seed: 1 };
        let b = FastHash { seed: 3 };
        assert_ne!(a.hash_one(42u64), b.hash_one(42u64));
        assert_eq!(a.hash_one(42u64), a.hash_one(42u64));
    }
}
