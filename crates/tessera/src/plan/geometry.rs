//! Geometry of chunks: boxes, flattened ranges, intersections and copy runs.
//!
//! A chunk is a box of a global tensor, optionally restricted to a `[start, end)` range of the
//! box's row-major flattening. Any such range is a union of at most `2·ndim - 1` boxes
//! ([`decompose_flat`]), so all geometry reduces to boxes plus a mapping from global
//! coordinates to positions in the chunk's data ([`Layout`]).

pub use crate::model::dims::numel;

pub use crate::model::dims::Dims;

/// A box in global coordinates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// Offset per axis.
    pub off: Dims,
    /// Extent per axis.
    pub shape: Dims,
}

impl Piece {
    /// A box.
    pub fn new(off: &[u64], shape: &[u64]) -> Self {
        Piece { off: off.into(), shape: shape.into() }
    }

    /// Elements in the box.
    pub fn numel(&self) -> u64 {
        numel(&self.shape)
    }

    /// The overlap of two boxes, if not empty.
    pub fn intersect(&self, other: &Piece) -> Option<Piece> {
        let n = self.off.len();
        if other.off.len() != n {
            return None;
        }
        let mut off = Dims::with_capacity(n);
        let mut shape = Dims::with_capacity(n);
        for d in 0..n {
            let lo = self.off[d].max(other.off[d]);
            let hi = (self.off[d] + self.shape[d]).min(other.off[d] + other.shape[d]);
            if hi <= lo {
                return None;
            }
            off.push(lo);
            shape.push(hi - lo);
        }
        Some(Piece { off, shape })
    }

    /// `[a:b, c:d]` rendering.
    pub fn describe(&self) -> String {
        let parts: Vec<String> =
            self.off.iter().zip(&self.shape).map(|(o, s)| format!("{}:{}", o, o.saturating_add(*s))).collect();
        format!("[{}]", parts.join(", "))
    }
}

/// Splits the `[start, end)` range of the row-major flattening of the box
/// (`box_off`, `box_shape`) into at most `2·ndim - 1` boxes, in flattening order. The box
/// must hold fewer than 2^64 elements (every caller's box lies inside a validated tensor).
pub fn decompose_flat(box_off: &[u64], box_shape: &[u64], start: u64, end: u64) -> Vec<Piece> {
    let mut out = Vec::new();
    decompose_flat_into(box_off, box_shape, start, end, &mut out);
    out
}

/// [`decompose_flat`], appending the boxes to `out` (validation decomposes millions of ranges
/// into one list per key).
///
/// Loops, never recursion per axis: the depth of a shape comes from other people's bytes, and
/// the parsers' cap on axes (`model::dims::MAX_AXES`) must not be what keeps the stack whole.
/// The range descends through the axes on which it lies within one index; at the first axis
/// where it spans several (`split`) it is the tail of one row (a chain of partial rows, emitted
/// deepest first), whole rows, then the head of one row (emitted outermost first).
pub fn decompose_flat_into(box_off: &[u64], box_shape: &[u64], start: u64, end: u64, out: &mut Vec<Piece>) {
    if start >= end {
        return;
    }
    let n = box_shape.len();
    if n == 0 {
        out.push(Piece::new(&[], &[]));
        return;
    }
    // inner[d]: elements of one index of axis d (saturating only for a box of more than 2^64
    // elements, which no caller passes).
    let mut inner = Dims::with_capacity(n);
    (0..n).for_each(|_| inner.push(1));
    for d in (0..n - 1).rev() {
        inner[d] = inner[d + 1].saturating_mul(box_shape[d + 1]);
    }
    let cut = Cut { off: box_off, shape: box_shape, inner: &inner };
    let mut prefix = Dims::with_capacity(n);
    let (mut s, mut e) = (start, end);
    let mut axis = 0;
    let (r0, r1) = loop {
        if axis == n - 1 {
            cut.emit(&prefix, s, e - s, out);
            return;
        }
        let inner = inner[axis];
        if inner == 0 {
            return;
        }
        let (r0, r1) = (s / inner, e / inner);
        if r0 != r1 {
            break (r0, r1);
        }
        prefix.push(box_off[axis] + r0);
        (s, e) = (s - r0 * inner, e - r0 * inner);
        axis += 1;
    };
    let split = axis;
    let inner_split = inner[split];
    let mut first_full = r0;
    if !s.is_multiple_of(inner_split) {
        prefix.push(box_off[split] + r0);
        cut.tail(&mut prefix, s % inner_split, out);
        prefix.pop();
        first_full = r0 + 1;
    }
    if r1 > first_full {
        cut.emit(&prefix, first_full, r1 - first_full, out);
    }
    if !e.is_multiple_of(inner_split) {
        prefix.push(box_off[split] + r1);
        cut.head(&mut prefix, e % inner_split, out);
    }
}

/// The box [`decompose_flat_into`] cuts, and the size of one index of each of its axes.
struct Cut<'a> {
    off: &'a [u64],
    shape: &'a [u64],
    inner: &'a [u64],
}

impl Cut<'_> {
    /// The box at index `prefix` of the leading axes, `[lo, lo + len)` on the next one, and
    /// whole on the axes after it.
    fn emit(&self, prefix: &[u64], lo: u64, len: u64, out: &mut Vec<Piece>) {
        let (n, axis) = (self.shape.len(), prefix.len());
        let mut off = Dims::with_capacity(n);
        let mut shape = Dims::with_capacity(n);
        for &p in prefix {
            off.push(p);
            shape.push(1);
        }
        off.push(self.off[axis] + lo);
        shape.push(len);
        for d in axis + 1..n {
            off.push(self.off[d]);
            shape.push(self.shape[d]);
        }
        out.push(Piece { off, shape });
    }

    /// The elements `[s, end of the row)` of the row at `prefix` (not empty, `s > 0`): the
    /// partial rows of the deeper axes, deepest first, then the whole rows after each. `prefix`
    /// is restored before returning.
    fn tail(&self, prefix: &mut Dims, mut s: u64, out: &mut Vec<Piece>) {
        let n = self.shape.len();
        let top = prefix.len();
        // Down the axes while the range starts inside a row: each level leaves, for the way
        // back up, its row index in `prefix`.
        loop {
            let axis = prefix.len();
            let e = self.inner[axis - 1];
            if s >= e {
                break;
            }
            if axis == n - 1 {
                self.emit(prefix, s, e - s, out);
                break;
            }
            let inner = self.inner[axis];
            if inner == 0 {
                break;
            }
            let r0 = s / inner;
            if s.is_multiple_of(inner) {
                let r1 = e / inner;
                if r1 > r0 {
                    self.emit(prefix, r0, r1 - r0, out);
                }
                break;
            }
            prefix.push(self.off[axis] + r0);
            s %= inner;
        }
        // Back up: after each partial row, the whole rows to the end of the level above.
        while prefix.len() > top {
            let r0 = prefix.pop().unwrap_or_default() - self.off[prefix.len()];
            let axis = prefix.len();
            let r1 = self.inner[axis - 1] / self.inner[axis];
            if r1 > r0 + 1 {
                self.emit(prefix, r0 + 1, r1 - (r0 + 1), out);
            }
        }
    }

    /// The elements `[0, e)` of the row at `prefix` (`e > 0`): whole rows, then the head of
    /// the next row, outermost first. Leaves `prefix` longer; the caller drops it.
    fn head(&self, prefix: &mut Dims, mut e: u64, out: &mut Vec<Piece>) {
        let n = self.shape.len();
        loop {
            let axis = prefix.len();
            if axis == n - 1 {
                self.emit(prefix, 0, e, out);
                return;
            }
            let inner = self.inner[axis];
            if inner == 0 {
                return;
            }
            let r1 = e / inner;
            if r1 > 0 {
                self.emit(prefix, 0, r1, out);
            }
            if e.is_multiple_of(inner) {
                return;
            }
            prefix.push(self.off[axis] + r1);
            e %= inner;
        }
    }
}

/// A part of a box: a sub-box, optionally restricted to a `[start, end)` range of its
/// row-major flattening (the shape of a stored chunk or of a load request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoxPart {
    /// Offset of the box, per axis.
    pub off: Vec<u64>,
    /// Shape of the box.
    pub shape: Vec<u64>,
    /// The part holds only this range of the box's flattening.
    pub flat: Option<(u64, u64)>,
}

impl BoxPart {
    /// Elements held.
    pub fn numel(&self) -> u64 {
        self.flat.map_or_else(|| numel(&self.shape), |(s, e)| e - s)
    }
}

/// Splits the box (`off`, `shape`) — or the range `flat` of its flattening — into parts of at
/// most `max_numel` elements (at least one), in row-major order: the elements of the parts,
/// one after the other, are those of the input in its order. Each part is a valid chunk of the
/// same tensor. A flattened range is cut into consecutive ranges of the same box. A whole box
/// is cut into sub-boxes along the first axis whose one-index slices fit: groups of rows along
/// axis 0 when a row fits; otherwise the axes before the cut axis are taken one index at a
/// time. An empty box, a scalar, or a box that fits, comes back whole.
#[cfg(test)]
pub fn split_box(off: &[u64], shape: &[u64], flat: Option<(u64, u64)>, max_numel: u64) -> Vec<BoxPart> {
    split_box_lazy(off, shape, flat, max_numel).collect()
}

/// [`split_box`] as an iterator: parts are computed one at a time, so a box of 2^56 elements
/// split into pieces of a few MiB costs nothing until (and only as far as) it is iterated.
/// [`BoxParts::count_parts`] tells how many parts there are without computing them.
pub fn split_box_lazy(off: &[u64], shape: &[u64], flat: Option<(u64, u64)>, max_numel: u64) -> BoxParts {
    let max = max_numel.max(1);
    let whole = BoxPart { off: off.to_vec(), shape: shape.to_vec(), flat };
    let state = if whole.numel() <= max {
        PartsState::Whole(Some(whole))
    } else if let Some((s, e)) = flat {
        PartsState::Flat { at: s, end: e, max }
    } else {
        // The first axis whose one-index slices fit; the last axis always does (slices of 1 element).
        let n = shape.len();
        let axis = (0..n).find(|&d| numel(&shape[d + 1..]) <= max).unwrap_or(n - 1);
        let rows = (max / numel(&shape[axis + 1..])).max(1);
        PartsState::Rows { axis, rows, idx: vec![0; axis], start: 0, done: false }
    };
    BoxParts { off: off.to_vec(), shape: shape.to_vec(), state }
}

/// The parts of a box, in order, computed as they are asked for (see [`split_box_lazy`]).
#[derive(Debug, Clone)]
pub struct BoxParts {
    off: Vec<u64>,
    shape: Vec<u64>,
    state: PartsState,
}

#[derive(Debug, Clone)]
enum PartsState {
    Whole(Option<BoxPart>),
    Flat {
        at: u64,
        end: u64,
        max: u64,
    },
    /// Groups of `rows` indices along `axis`, for each index `idx` of the axes before it.
    Rows {
        axis: usize,
        rows: u64,
        idx: Vec<u64>,
        start: u64,
        done: bool,
    },
}

impl BoxParts {
    /// How many parts are left, computed without making them (saturating).
    pub fn count_parts(&self) -> u64 {
        match &self.state {
            PartsState::Whole(p) => p.is_some() as u64,
            PartsState::Flat { at, end, max } => end.saturating_sub(*at).div_ceil(*max),
            PartsState::Rows { axis, rows, done, .. } => {
                if *done {
                    return 0;
                }
                // From the start (the count is only asked for before iterating).
                let lead = self.shape[..*axis].iter().fold(1u64, |a, &n| a.saturating_mul(n));
                lead.saturating_mul(self.shape[*axis].div_ceil(*rows))
            }
        }
    }
}

impl Iterator for BoxParts {
    type Item = BoxPart;

    fn next(&mut self) -> Option<BoxPart> {
        match &mut self.state {
            PartsState::Whole(p) => p.take(),
            PartsState::Flat { at, end, max } => {
                if *at >= *end {
                    return None;
                }
                let stop = at.saturating_add(*max).min(*end);
                let part = BoxPart { off: self.off.clone(), shape: self.shape.clone(), flat: Some((*at, stop)) };
                *at = stop;
                Some(part)
            }
            PartsState::Rows { axis, rows, idx, start, done } => {
                if *done {
                    return None;
                }
                let axis = *axis;
                let len = (*rows).min(self.shape[axis] - *start);
                let mut p_off = self.off.clone();
                let mut p_shape = self.shape.clone();
                for d in 0..axis {
                    p_off[d] += idx[d];
                    p_shape[d] = 1;
                }
                p_off[axis] += *start;
                p_shape[axis] = len;
                *start += len;
                if *start >= self.shape[axis] {
                    *start = 0;
                    // Next index of the leading axes, last axis fastest.
                    let mut d = axis;
                    loop {
                        if d == 0 {
                            *done = true;
                            break;
                        }
                        d -= 1;
                        idx[d] += 1;
                        if idx[d] < self.shape[d] {
                            break;
                        }
                        idx[d] = 0;
                    }
                }
                Some(BoxPart { off: p_off, shape: p_shape, flat: None })
            }
        }
    }
}

/// Where the elements of a chunk live in its data: a box whose row-major flattening, shifted
/// by `base` elements (the start of a flattened range), indexes the data.
#[derive(Debug, Clone, Copy)]
pub struct Layout<'s> {
    /// Offset of the box in global coordinates.
    pub box_off: &'s [u64],
    /// Shape of the box.
    pub box_shape: &'s [u64],
    /// Flattened index (within the box) of the first element of the data.
    pub base: u64,
}

impl Layout<'_> {
    fn position(&self, x: &[u64]) -> u64 {
        let mut pos = 0u64;
        for ((&xd, &size), &off) in x.iter().zip(self.box_shape).zip(self.box_off) {
            pos = pos * size + (xd - off);
        }
        pos - self.base
    }
}

/// Calls `emit(src_elem, dst_elem, len)` for each maximal run of `region` that is contiguous in
/// both layouts, in row-major order. `region` must lie inside both data ranges.
pub fn copy_runs(src: Layout<'_>, dst: Layout<'_>, region: &Piece, emit: &mut dyn FnMut(u64, u64, u64)) {
    let n = region.shape.len();
    if region.numel() == 0 {
        return;
    }
    if n == 0 {
        emit(src.position(&[]), dst.position(&[]), 1);
        return;
    }
    // Axes from `m` on are walked as one run: every axis after `m` is full in both boxes.
    let mut m = n - 1;
    while m > 0 && region.shape[m] == src.box_shape[m] && region.shape[m] == dst.box_shape[m] {
        m -= 1;
    }
    let run: u64 = numel(&region.shape[m..]);
    let src_strides = strides(src.box_shape);
    let dst_strides = strides(dst.box_shape);
    let mut idx = vec![0u64; m];
    let mut x = region.off.to_vec();
    let mut s = src.position(&x);
    let mut t = dst.position(&x);
    let (mut ps, mut pt, mut plen) = (s, t, 0u64);
    loop {
        if plen > 0 && ps + plen == s && pt + plen == t {
            plen += run;
        } else {
            if plen > 0 {
                emit(ps, pt, plen);
            }
            (ps, pt, plen) = (s, t, run);
        }
        // Odometer over the outer axes [0, m).
        let mut d = m;
        loop {
            if d == 0 {
                emit(ps, pt, plen);
                return;
            }
            d -= 1;
            idx[d] += 1;
            x[d] += 1;
            s += src_strides[d];
            t += dst_strides[d];
            if idx[d] < region.shape[d] {
                break;
            }
            s -= src_strides[d] * idx[d];
            t -= dst_strides[d] * idx[d];
            x[d] = region.off[d];
            idx[d] = 0;
        }
    }
}

/// Row-major strides (in elements) of a shape.
pub fn strides(shape: &[u64]) -> Vec<u64> {
    let mut st = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        st[d] = st[d + 1] * shape[d + 1];
    }
    st
}

/// Checks that `pieces` tile the box `[0, global)` exactly: every element covered once.
/// Every piece must lie inside the box.
pub fn check_tiling(global: &[u64], pieces: &[Piece]) -> Result<(), String> {
    let faults = tiling_faults(global, pieces);
    match faults.overlap.or(faults.gap) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// What keeps pieces from tiling a box: the first overlap found and the first uncovered
/// element found, each described with its coordinates.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TilingFaults {
    /// Elements covered by more than one piece.
    pub overlap: Option<String>,
    /// Elements covered by none.
    pub gap: Option<String>,
}

/// Finds overlaps and gaps of `pieces` in the box `[0, global)`: a gap does not hide an
/// overlap elsewhere; a piece reaching outside the box is reported as the overlap. Sweeps axis by axis; between consecutive boundaries the set of
/// active pieces is checked once per change, so product-structured layouts cost O(n log n).
pub fn tiling_faults(global: &[u64], pieces: &[Piece]) -> TilingFaults {
    let mut faults = TilingFaults::default();
    let live: Vec<&Piece> = pieces.iter().filter(|p| p.numel() > 0).collect();
    let outside = |p: &&&Piece| {
        p.off.len() != global.len()
            || (0..global.len()).any(|d| p.off[d].checked_add(p.shape[d]).is_none_or(|end| end > global[d]))
    };
    if let Some(p) = live.iter().find(outside) {
        faults.overlap = Some(format!("box {} exceeds the global shape {global:?}", p.describe()));
        return faults;
    }
    if global.contains(&0) {
        return faults;
    }
    if global.is_empty() {
        match live.len() {
            1 => {}
            0 => faults.gap = Some("gap: the scalar is stored by no chunk".into()),
            k => faults.overlap = Some(format!("overlap: the scalar is stored by {k} chunks")),
        }
        return faults;
    }
    // Real layouts (products of splits, flat ranges of them) sweep in O(n log n) piece visits;
    // a crafted one (each column split at another row) makes the sweep quadratic. Past this
    // many visits the layout is refused rather than checked for minutes.
    let n = live.len() as u64;
    let budget = n.saturating_mul(64 * (u64::from(n.max(2).ilog2()) + 1)).saturating_add(1 << 20);
    if let Err(overlap) = tile(global, &live, &mut faults.gap, budget) {
        faults.overlap = Some(overlap);
    }
    faults
}

/// The uncovered element at `prefix` followed by `v`, zeros after.
fn gap_at(global: &[u64], prefix: &[u64], v: u64) -> String {
    let mut c = prefix.to_vec();
    c.push(v);
    c.resize(global.len(), 0);
    format!("gap: the element at {c:?} (and those after it on that axis, up to the next chunk) is stored by no chunk")
}

/// The sweep of one axis (not the last) in progress: its pieces sorted by where they start on
/// the axis, the boundaries where the set of pieces covering the axis changes, and that set.
struct Sweep<'p> {
    sorted: Vec<&'p Piece>,
    bounds: Vec<u64>,
    /// The next boundary to visit.
    at: usize,
    active: Vec<&'p Piece>,
    /// The first piece of `sorted` not yet made active.
    next: usize,
}

/// Sweeps the axes of `global` depth first: on each axis but the last, between consecutive
/// boundaries, the pieces covering that stretch are swept on the next axis (once per change
/// of the set); on the last axis they must follow one another without overlap. Records the
/// first gap in `gap` and goes on; returns the first overlap.
///
/// One [`Sweep`] per axis on a stack of its own, not a recursion per axis: the number of axes
/// comes from other people's bytes, and no shape may overflow the thread's stack.
fn tile(global: &[u64], pieces: &[&Piece], gap: &mut Option<String>, mut budget: u64) -> Result<(), String> {
    let n = global.len();
    let mut prefix: Vec<u64> = Vec::with_capacity(n);
    let mut sweeps: Vec<Sweep<'_>> = Vec::with_capacity(n);
    // The pieces of the axis to enter next: all of them on axis 0, then the active set of the
    // boundary the deepest sweep stopped at (whose start is pushed on `prefix`).
    let mut enter: Option<Vec<&Piece>> = Some(pieces.to_vec());
    loop {
        if let Some(mut sorted) = enter.take() {
            let axis = sweeps.len();
            budget = budget.checked_sub(sorted.len() as u64).ok_or_else(|| {
                "the chunk layout is too irregular to check (its tiling sweep exceeds O(n log n) steps)".to_string()
            })?;
            sorted.sort_by_key(|p| (p.off[axis], p.shape[axis]));
            if axis == n - 1 {
                sweep_last(global, &sorted, &prefix, gap)?;
                prefix.pop();
            } else {
                let g = global[axis];
                let mut bounds: Vec<u64> = Vec::with_capacity(sorted.len() * 2 + 2);
                bounds.push(0);
                bounds.push(g);
                for p in &sorted {
                    bounds.push(p.off[axis]);
                    bounds.push(p.off[axis] + p.shape[axis]);
                }
                bounds.sort_unstable();
                bounds.dedup();
                sweeps.push(Sweep { sorted, bounds, at: 0, active: Vec::new(), next: 0 });
            }
        }
        let Some(axis) = sweeps.len().checked_sub(1) else { return Ok(()) };
        let sweep = &mut sweeps[axis];
        let g = global[axis];
        while sweep.at + 1 < sweep.bounds.len() {
            let lo = sweep.bounds[sweep.at];
            sweep.at += 1;
            if lo >= g {
                sweep.at = sweep.bounds.len();
                break;
            }
            let before = sweep.active.len();
            sweep.active.retain(|p| p.off[axis] + p.shape[axis] > lo);
            let mut changed = sweep.active.len() != before;
            while sweep.next < sweep.sorted.len() && sweep.sorted[sweep.next].off[axis] <= lo {
                let p = sweep.sorted[sweep.next];
                if p.off[axis] + p.shape[axis] > lo {
                    sweep.active.push(p);
                    changed = true;
                }
                sweep.next += 1;
            }
            if sweep.active.is_empty() {
                if gap.is_none() {
                    *gap = Some(gap_at(global, &prefix, lo));
                }
                continue;
            }
            if changed || lo == 0 {
                prefix.push(lo);
                enter = Some(sweep.active.clone());
                break;
            }
        }
        if enter.is_none() {
            // This axis is swept: back to the boundary of the axis before it.
            sweeps.pop();
            prefix.pop();
        }
    }
}

/// The last axis of [`tile`]: `sorted` (by start) must follow one another without overlap;
/// the first uncovered stretch goes to `gap`.
fn sweep_last(global: &[u64], sorted: &[&Piece], prefix: &[u64], gap: &mut Option<String>) -> Result<(), String> {
    let axis = global.len() - 1;
    let mut cursor = 0u64;
    for p in sorted {
        let (lo, hi) = (p.off[axis], p.off[axis] + p.shape[axis]);
        if lo > cursor && gap.is_none() {
            *gap = Some(gap_at(global, prefix, cursor));
        }
        if lo < cursor {
            let mut c = prefix.to_vec();
            c.push(lo);
            return Err(format!("overlap: the element at {c:?} is stored by more than one chunk"));
        }
        cursor = hi;
    }
    if cursor < global[axis] && gap.is_none() {
        *gap = Some(gap_at(global, prefix, cursor));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::TestRng;

    /// The recursive [`decompose_flat`] the loops replaced: the reference they must match.
    fn decompose_reference(box_off: &[u64], box_shape: &[u64], start: u64, end: u64) -> Vec<Piece> {
        fn rec(off: &[u64], shape: &[u64], axis: usize, s: u64, e: u64, prefix: &mut Vec<u64>, out: &mut Vec<Piece>) {
            let n = shape.len();
            let emit = |prefix: &[u64], lo: u64, len: u64, out: &mut Vec<Piece>| {
                let mut o = prefix.to_vec();
                let mut sh = vec![1; prefix.len()];
                o.push(off[axis] + lo);
                sh.push(len);
                o.extend_from_slice(&off[axis + 1..]);
                sh.extend_from_slice(&shape[axis + 1..]);
                out.push(Piece::new(&o, &sh));
            };
            if s >= e {
                return;
            }
            if axis == n - 1 {
                return emit(prefix, s, e - s, out);
            }
            let inner = numel(&shape[axis + 1..]);
            if inner == 0 {
                return;
            }
            let (r0, r1) = (s / inner, e / inner);
            if r0 == r1 {
                prefix.push(off[axis] + r0);
                rec(off, shape, axis + 1, s - r0 * inner, e - r0 * inner, prefix, out);
                prefix.pop();
                return;
            }
            let mut first_full = r0;
            if !s.is_multiple_of(inner) {
                prefix.push(off[axis] + r0);
                rec(off, shape, axis + 1, s % inner, inner, prefix, out);
                prefix.pop();
                first_full = r0 + 1;
            }
            if r1 > first_full {
                emit(prefix, first_full, r1 - first_full, out);
            }
            if !e.is_multiple_of(inner) {
                prefix.push(off[axis] + r1);
                rec(off, shape, axis + 1, 0, e % inner, prefix, out);
                prefix.pop();
            }
        }
        let mut out = Vec::new();
        if start >= end {
            return out;
        }
        if box_shape.is_empty() {
            return vec![Piece::new(&[], &[])];
        }
        rec(box_off, box_shape, 0, start, end, &mut Vec::new(), &mut out);
        out
    }

    /// The recursive tiling sweep the loop replaced (with the same budget): the reference.
    fn tiling_reference(global: &[u64], pieces: &[Piece]) -> TilingFaults {
        #[allow(clippy::too_many_arguments)]
        fn rec(
            global: &[u64],
            pieces: &[&Piece],
            axis: usize,
            prefix: &mut Vec<u64>,
            gap: &mut Option<String>,
            budget: &mut u64,
        ) -> Result<(), String> {
            let n = global.len();
            let g = global[axis];
            *budget = budget.checked_sub(pieces.len() as u64).ok_or_else(|| {
                "the chunk layout is too irregular to check (its tiling sweep exceeds O(n log n) steps)".to_string()
            })?;
            let mut sorted: Vec<&Piece> = pieces.to_vec();
            sorted.sort_by_key(|p| (p.off[axis], p.shape[axis]));
            if axis == n - 1 {
                return sweep_last(global, &sorted, prefix, gap);
            }
            let mut bounds: Vec<u64> = vec![0, g];
            for p in &sorted {
                bounds.push(p.off[axis]);
                bounds.push(p.off[axis] + p.shape[axis]);
            }
            bounds.sort_unstable();
            bounds.dedup();
            let mut active: Vec<&Piece> = Vec::new();
            let mut next = 0usize;
            for &lo in &bounds[..bounds.len() - 1] {
                if lo >= g {
                    break;
                }
                let before = active.len();
                active.retain(|p| p.off[axis] + p.shape[axis] > lo);
                let mut changed = active.len() != before;
                while next < sorted.len() && sorted[next].off[axis] <= lo {
                    if sorted[next].off[axis] + sorted[next].shape[axis] > lo {
                        active.push(sorted[next]);
                        changed = true;
                    }
                    next += 1;
                }
                if active.is_empty() {
                    if gap.is_none() {
                        *gap = Some(gap_at(global, prefix, lo));
                    }
                    continue;
                }
                if changed || lo == 0 {
                    prefix.push(lo);
                    let r = rec(global, &active, axis + 1, prefix, gap, budget);
                    prefix.pop();
                    r?;
                }
            }
            Ok(())
        }
        let mut faults = TilingFaults::default();
        let live: Vec<&Piece> = pieces.iter().filter(|p| p.numel() > 0).collect();
        if global.is_empty() || global.contains(&0) || live.iter().any(|p| p.off.len() != global.len()) {
            return tiling_faults(global, pieces);
        }
        if live.iter().any(|p| (0..global.len()).any(|d| p.off[d] + p.shape[d] > global[d])) {
            return tiling_faults(global, pieces);
        }
        let n = live.len() as u64;
        let mut budget = n.saturating_mul(64 * (u64::from(n.max(2).ilog2()) + 1)).saturating_add(1 << 20);
        if let Err(overlap) = rec(global, &live, 0, &mut Vec::new(), &mut faults.gap, &mut budget) {
            faults.overlap = Some(overlap);
        }
        faults
    }

    #[test]
    fn decompose_matches_the_recursive_reference() {
        let mut rng = TestRng::new(7);
        for case in 0..1000 {
            let ndim = 1 + rng.below(4) as usize;
            let shape: Vec<u64> = (0..ndim).map(|_| rng.below(5)).collect();
            let off: Vec<u64> = (0..ndim).map(|_| rng.below(3)).collect();
            let total = numel(&shape);
            for s in 0..=total {
                for e in s..=total {
                    assert_eq!(
                        decompose_flat(&off, &shape, s, e),
                        decompose_reference(&off, &shape, s, e),
                        "case {case}: box at {off:?} of {shape:?}, range {s}..{e}"
                    );
                }
            }
        }
    }

    #[test]
    fn tiling_matches_the_recursive_reference() {
        let mut rng = TestRng::new(11);
        for case in 0..20_000 {
            let ndim = 1 + rng.below(4) as usize;
            let global: Vec<u64> = (0..ndim).map(|_| 1 + rng.below(4)).collect();
            // Random boxes: some tile, most overlap or leave gaps.
            let count = rng.below(7) as usize;
            let pieces: Vec<Piece> = (0..count)
                .map(|_| {
                    let off: Vec<u64> = global.iter().map(|&g| rng.below(g)).collect();
                    let shape: Vec<u64> = off.iter().zip(&global).map(|(&o, &g)| 1 + rng.below(g - o)).collect();
                    Piece::new(&off, &shape)
                })
                .collect();
            assert_eq!(
                tiling_faults(&global, &pieces),
                tiling_reference(&global, &pieces),
                "case {case}: {global:?} {pieces:?}"
            );
            // Exact tilings, cut row-major from flat ranges.
            let total = numel(&global);
            let mut cuts: Vec<u64> = (0..rng.below(4)).map(|_| rng.below(total + 1)).collect();
            cuts.extend([0, total]);
            cuts.sort_unstable();
            let zeros = vec![0; ndim];
            let tiles: Vec<Piece> = cuts.windows(2).flat_map(|w| decompose_flat(&zeros, &global, w[0], w[1])).collect();
            assert_eq!(tiling_faults(&global, &tiles), TilingFaults::default(), "{global:?} {cuts:?}");
            assert_eq!(tiling_faults(&global, &tiles), tiling_reference(&global, &tiles));
        }
    }

    #[test]
    fn deep_shapes_do_not_overflow_a_small_stack() {
        // 20,000 axes (a parser that forgot the cap on axes) on a 128 KiB stack: a frame per
        // axis would need megabytes.
        let deep = 20_000;
        let run = move || {
            let mut global = vec![1u64; deep];
            global.extend([3, 5]);
            let zeros = vec![0u64; deep + 2];
            // Elements 2..13 of 15: the tail of row 0, row 1, the head of row 2.
            let pieces = decompose_flat(&zeros, &global, 2, 13);
            let at = |row: u64, col: u64| {
                let mut o = vec![0u64; deep];
                o.extend([row, col]);
                o
            };
            let mut one = vec![1u64; deep];
            one.extend([1, 3]);
            let mut row = vec![1u64; deep];
            row.extend([1, 5]);
            assert_eq!(
                pieces,
                vec![Piece::new(&at(0, 2), &one), Piece::new(&at(1, 0), &row), Piece::new(&at(2, 0), &one)]
            );
            // A tiling of the whole tensor, and one with a gap and an overlap.
            let whole: Vec<Piece> =
                [(0, 7), (7, 15)].iter().flat_map(|&(s, e)| decompose_flat(&zeros, &global, s, e)).collect();
            assert_eq!(tiling_faults(&global, &whole), TilingFaults::default());
            let faults = tiling_faults(&global, &[pieces[0].clone(), pieces[1].clone(), pieces[1].clone()]);
            assert!(faults.overlap.is_some_and(|o| o.contains("overlap")));
            assert!(faults.gap.is_some_and(|g| g.contains("gap")));
        };
        std::thread::Builder::new().stack_size(128 << 10).spawn(run).unwrap().join().unwrap();
    }

    #[test]
    fn a_layout_that_makes_the_sweep_quadratic_is_refused() {
        // Column j split at row j: a valid tiling whose active set changes at every row.
        let n = 3000u64;
        let mut pieces = Vec::new();
        for j in 0..n {
            if j > 0 {
                pieces.push(Piece::new(&[0, j], &[j, 1]));
            }
            pieces.push(Piece::new(&[j, j], &[n - j, 1]));
        }
        let faults = tiling_faults(&[n, n], &pieces);
        assert!(faults.overlap.as_deref().is_some_and(|e| e.contains("too irregular")), "{faults:?}");
        // The same pieces for a small tensor are checked (and tile it).
        let small: Vec<Piece> = pieces.into_iter().filter(|p| p.off[1] < 8 && p.off[0] < 8).collect();
        let small: Vec<Piece> =
            small.into_iter().map(|p| Piece::new(&p.off, &[p.shape[0].min(8 - p.off[0]), 1])).collect();
        assert_eq!(tiling_faults(&[8, 8], &small), TilingFaults::default());
    }

    #[test]
    fn decompose_covers_range_in_order() {
        let shape = [3u64, 4, 5];
        let off = [10u64, 20, 30];
        for s in 0..60 {
            for e in s..=60 {
                let pieces = decompose_flat(&off, &shape, s, e);
                assert!(pieces.len() <= 5);
                let layout = Layout { box_off: &off, box_shape: &shape, base: 0 };
                let mut seen = Vec::new();
                for p in &pieces {
                    copy_runs(layout, layout, p, &mut |a, _b, len| seen.extend(a..a + len));
                }
                assert_eq!(seen, (s..e).collect::<Vec<_>>(), "range {s}..{e}");
            }
        }
    }

    /// Row-major positions, within the box (`off`, `shape`), of the elements of `p`, in order.
    fn positions(off: &[u64], shape: &[u64], p: &BoxPart) -> Vec<u64> {
        let pieces = match p.flat {
            Some((s, e)) => decompose_flat(&p.off, &p.shape, s, e),
            None => vec![Piece::new(&p.off, &p.shape)],
        };
        let st = strides(shape);
        let mut out = Vec::new();
        for piece in pieces {
            let total = piece.numel();
            let ps = strides(&piece.shape);
            for k in 0..total {
                let mut pos = 0;
                for d in 0..shape.len() {
                    let i = (k / ps[d]) % piece.shape[d];
                    pos += (piece.off[d] + i - off[d]) * st[d];
                }
                out.push(pos);
            }
        }
        out
    }

    #[test]
    fn split_box_cuts_in_order_within_the_limit() {
        type Case<'a> = (&'a [u64], &'a [u64], Option<(u64, u64)>, u64);
        let cases: &[Case<'_>] = &[
            (&[0, 0], &[10, 6], None, 13),        // rows of 6: 2 rows per part
            (&[4, 2], &[10, 6], None, 60),        // fits
            (&[0, 0, 0], &[2, 3, 8], None, 5),    // a row (24) does not fit, nor a plane slice (8)
            (&[1, 0, 0], &[3, 4, 5], None, 20),   // exactly one row per part
            (&[0, 0], &[5, 7], Some((3, 30)), 4), // flat range: consecutive ranges
            (&[], &[], None, 1),                  // scalar
            (&[0, 0], &[0, 9], None, 2),          // empty
            (&[0], &[17], None, 1),               // one element per part
        ];
        for &(off, shape, flat, max) in cases {
            let parts = split_box(off, shape, flat, max);
            assert_eq!(split_box_lazy(off, shape, flat, max).count_parts(), parts.len() as u64, "{shape:?} {max}");
            assert!(parts.iter().all(|p| p.numel() <= max.max(1) || parts.len() == 1), "{shape:?} {max}: {parts:?}");
            let got: Vec<u64> = parts.iter().flat_map(|p| positions(off, shape, p)).collect();
            let whole = BoxPart { off: off.to_vec(), shape: shape.to_vec(), flat };
            assert_eq!(got, positions(off, shape, &whole), "{shape:?} {flat:?} {max}: {parts:?}");
            for p in &parts {
                for d in 0..shape.len() {
                    assert!(p.off[d] >= off[d] && p.off[d] + p.shape[d] <= off[d] + shape[d], "{p:?}");
                }
            }
        }
        assert_eq!(split_box(&[0, 0], &[10, 6], None, 13).len(), 5);
        assert!(split_box(&[0, 0], &[10, 6], None, 13).iter().all(|p| p.shape[1] == 6), "rows along axis 0");
        assert_eq!(split_box(&[0, 0, 0], &[2, 3, 8], None, 5).len(), 2 * 3 * 2);
        // 2^56 elements in parts of 2^20: 2^36 parts, counted and begun without making them all.
        let mut huge = split_box_lazy(&[0, 0], &[1 << 28, 1 << 28], None, 1 << 20);
        assert_eq!(huge.count_parts(), 1 << 36);
        assert_eq!(huge.next().map(|p| p.shape), Some(vec![1, 1 << 20]));
        let flat = split_box_lazy(&[0], &[1 << 56], Some((0, 1 << 56)), 1 << 20);
        assert_eq!(flat.count_parts(), 1 << 36);
    }

    #[test]
    fn copy_runs_merges_full_rows() {
        let shape = [4u64, 8];
        let src = Layout { box_off: &[0, 0], box_shape: &shape, base: 0 };
        let dst_shape = [2u64, 8];
        let dst = Layout { box_off: &[2, 0], box_shape: &dst_shape, base: 0 };
        let mut runs = Vec::new();
        copy_runs(src, dst, &Piece::new(&[2, 0], &[2, 8]), &mut |a, b, l| runs.push((a, b, l)));
        assert_eq!(runs, vec![(16, 0, 16)]);
        let mut runs = Vec::new();
        copy_runs(src, src, &Piece::new(&[1, 2], &[2, 3]), &mut |a, b, l| runs.push((a, b, l)));
        assert_eq!(runs, vec![(10, 10, 3), (18, 18, 3)]);
    }

    #[test]
    fn tiling_finds_gap_and_overlap() {
        let g = [4u64, 4];
        let ok = vec![Piece::new(&[0, 0], &[2, 4]), Piece::new(&[2, 0], &[2, 2]), Piece::new(&[2, 2], &[2, 2])];
        assert!(check_tiling(&g, &ok).is_ok());
        let gap = vec![Piece::new(&[0, 0], &[2, 4]), Piece::new(&[2, 0], &[2, 2])];
        assert!(check_tiling(&g, &gap).unwrap_err().contains("gap"));
        let overlap = vec![Piece::new(&[0, 0], &[3, 4]), Piece::new(&[2, 0], &[2, 4])];
        assert!(check_tiling(&g, &overlap).unwrap_err().contains("overlap"));
    }
}
