//! Seeded random cases for property tests, without a property-testing framework (it
//! would be one more dependency of every example build; see `benches/Cargo.toml`).
//!
//! `cases(n, |rng| ...)` runs the body `n` times, each with its own generator. A
//! failing case is reported with its seed; `EVENTPLANE_TEST_SEED=<seed>` runs that
//! one case again (and `EVENTPLANE_TEST_CASES=<n>` runs more of them).

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

/// SplitMix64: small, fast, and every seed gives a full-quality stream.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in `range` (half-open, not empty).
    pub fn range(&mut self, range: std::ops::Range<usize>) -> usize {
        assert!(range.start < range.end, "empty range");
        let span = (range.end - range.start) as u64;
        range.start + (self.next_u64() % span) as usize
    }

    pub fn bool(&mut self) -> bool {
        self.next_u64() & 1 == 1
    }

    /// `len` random bytes, biased toward the values parsers treat specially.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len)
            .map(|_| match self.next_u64() % 8 {
                0 => 0,
                1 => 0xff,
                2 => self.range(0..8) as u8,
                _ => self.next_u64() as u8,
            })
            .collect()
    }

    /// A vector of `len` in `len_range` items made by `item`.
    pub fn vec<T>(
        &mut self,
        len_range: std::ops::Range<usize>,
        mut item: impl FnMut(&mut Self) -> T,
    ) -> Vec<T> {
        let len = self.range(len_range);
        (0..len).map(|_| item(self)).collect()
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

/// Runs `body` for `n` seeded cases (or the one case `EVENTPLANE_TEST_SEED` names).
/// The seeds are fixed, so a run is repeatable; a failure names its seed.
pub fn cases(n: usize, mut body: impl FnMut(&mut Rng)) {
    let seeds: Vec<u64> = match env_u64("EVENTPLANE_TEST_SEED") {
        Some(seed) => vec![seed],
        None => {
            let n = env_u64("EVENTPLANE_TEST_CASES").map_or(n, |n| n as usize);
            let mut master = Rng::new(0x6576_656e_7470_6c61);
            (0..n).map(|_| master.next_u64()).collect()
        }
    };
    for seed in seeds {
        let mut rng = Rng::new(seed);
        if let Err(cause) = catch_unwind(AssertUnwindSafe(|| body(&mut rng))) {
            eprintln!("failing case: EVENTPLANE_TEST_SEED={seed:#x}");
            resume_unwind(cause);
        }
    }
}
