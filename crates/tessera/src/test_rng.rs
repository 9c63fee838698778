//! A tiny deterministic generator for unit tests: reproducible runs, no dependency.

/// A 64-bit linear congruential generator (Knuth's MMIX constants).
pub(crate) struct TestRng(u64);

impl TestRng {
    pub(crate) fn new(seed: u64) -> Self {
        TestRng(seed)
    }

    /// The next state: every bit is used by callers that need raw bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0
    }

    /// A number in `[0, n)` from the high bits (the low bits of an LCG are weak).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        (self.next_u64() >> 33) % n
    }
}
