//! [`UnpickleLimits`] and the accounting against them while the opcodes run: every value
//! pushed and every string byte read is charged as it happens, so that a pickle over a limit
//! fails before it has allocated much. The result's own check is in `tree`.

use super::machine::{Id, Machine, Node};
use super::PickleValue;
use crate::error::Result;

/// Bounds on what one pickle may make the unpickler do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnpickleLimits {
    /// Deepest nesting of containers and objects (in the result; scalars do not count).
    pub max_depth: usize,
    /// Most values created (every opcode that pushes counts, and every item a known call or a
    /// merging `BUILD` copies); separately, most values in the result, where a value shared
    /// through the memo counts once per copy.
    pub max_values: usize,
    /// Most bytes of string and bytes payloads, in total (read from the input; separately,
    /// held by the result, counting every copy and the class names of objects).
    pub max_bytes: usize,
    /// Memory budget relative to the input: the values built (in the unpickler's arena, and
    /// again in the result, where a shared value counts once per copy) and their string bytes,
    /// estimated at their in-memory size, may take at most `output_floor + output_per_input_byte
    /// × input length` bytes. This is what keeps a small pickle from growing to gigabytes
    /// (memo sharing, millions of `None`s) whatever the absolute limits above allow.
    pub output_per_input_byte: usize,
    /// See [`UnpickleLimits::output_per_input_byte`].
    pub output_floor: usize,
}

impl Default for UnpickleLimits {
    fn default() -> Self {
        UnpickleLimits {
            max_depth: 512,
            max_values: 50_000_000,
            max_bytes: 1 << 32,
            output_per_input_byte: 32,
            output_floor: 8 << 20,
        }
    }
}

/// Estimated bytes one value costs in memory, for [`UnpickleLimits::output_per_input_byte`]:
/// a [`PickleValue`] of the result and a word of the allocation of the container holding it
/// (64 bytes), the larger of that and an arena node with its id. The arena's nodes are smaller
/// (16 bytes, and none for small scalars), so the estimate is the result's, as it was before
/// the arena was made compact: the same pickles fit the budget.
const VALUE_COST: u64 = {
    let node = std::mem::size_of::<Node>() + std::mem::size_of::<Id>();
    let value = std::mem::size_of::<PickleValue>() + std::mem::size_of::<u64>();
    (if node > value { node } else { value }) as u64
};

impl Machine<'_> {
    /// Counts `n` more bytes of strings read, against `max_bytes` and the budget.
    pub(super) fn charge_bytes(&mut self, n: usize) -> Result<()> {
        self.bytes = self.bytes.saturating_add(n);
        if self.bytes > self.limits.max_bytes {
            return Err(self.err(format!("more than {} bytes of strings (max_bytes)", self.limits.max_bytes)));
        }
        self.check_budget(self.values as u64, self.bytes as u64, "")
    }

    /// Counts `n` more values pushed or copied, against `max_values` and the budget.
    pub(super) fn charge_values(&mut self, n: usize) -> Result<()> {
        self.values = self.values.saturating_add(n);
        if self.values > self.limits.max_values {
            return Err(self.err(format!("more than {} values (max_values)", self.limits.max_values)));
        }
        self.check_budget(self.values as u64, self.bytes as u64, "")
    }

    /// The memory budget relative to the input length ([`UnpickleLimits::output_per_input_byte`]).
    fn budget(&self) -> u64 {
        (self.data.len() as u64)
            .saturating_mul(self.limits.output_per_input_byte as u64)
            .saturating_add(self.limits.output_floor as u64)
    }

    /// Fails when `values` values holding `bytes` bytes of strings exceed [`Machine::budget`].
    pub(super) fn check_budget(&self, values: u64, bytes: u64, what: &str) -> Result<()> {
        let estimate = values.saturating_mul(VALUE_COST).saturating_add(bytes);
        if estimate > self.budget() {
            return Err(self.err(format!(
                "{what}{values} values and {bytes} bytes of strings would take about {estimate} bytes, more than \
                 the budget of {} bytes for a {}-byte pickle (output_per_input_byte {}, output_floor {})",
                self.budget(),
                self.data.len(),
                self.limits.output_per_input_byte,
                self.limits.output_floor
            )));
        }
        Ok(())
    }
}
