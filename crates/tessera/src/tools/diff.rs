//! Comparison of two checkpoints of any readable formats: tensors (streamed in row slices, like
//! export), sharded objects (payload bytes), common state and content metadata.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::error::{Error, Result};
use crate::format::{CheckpointIndex, ObjectEntry, TensorEntry};
use crate::formats::common_value;
use crate::formats::dcp_values::{assemble, torch_blob};
use crate::formats::pickle::PickleValue;
use crate::formats::torch_save::{decode_archive, zip_entries};
use crate::formats::{OBJECT_TAG_TORCH, OBJECT_TAG_TORCH_LIST, OBJECT_TAG_VALUE};
use crate::load::engine::{read_object, LoadOptions};
use crate::load::open::open_checkpoint;
use crate::model::dtype::elements_to_f64;
use crate::model::dtype::{element_to_f64, DType};
use crate::model::{path_string, PathSeg, StatePath, Value};
use crate::plan::geometry::split_box_lazy;
use crate::storage::Storage;
use crate::tools::pipeline::{
    batched, batches, check_memory_budget, job_bytes, load_parts, pipeline, TensorPart, DEFAULT_MEMORY_BUDGET,
};

/// How to compare.
#[derive(Debug, Clone)]
pub struct DiffOptions {
    /// Absolute tolerance: elements `a`, `b` are equal when `|a − b| ≤ atol` (compared as f64;
    /// NaN equals NaN). With 0 (the default) and equal dtypes, elements must be equal byte for
    /// byte.
    pub atol: f64,
    /// Compare only these tensor and object keys (each must be in one checkpoint at least);
    /// the common state and content metadata are then not compared. `None`: everything.
    pub keys: Option<Vec<String>>,
    /// About the most bytes of tensor data (both sides) held in memory at once (default 512 MiB).
    pub memory_budget: u64,
    /// IO threads of the reads.
    pub threads: usize,
}

impl Default for DiffOptions {
    fn default() -> Self {
        DiffOptions {
            atol: 0.0,
            keys: None,
            memory_budget: DEFAULT_MEMORY_BUDGET,
            threads: crate::threads::default_threads(),
        }
    }
}

/// How the values of one tensor differ.
#[derive(Debug, Clone, PartialEq)]
pub struct ValueDiff {
    /// Elements that differ.
    pub count: u64,
    /// Largest `|a − b|` over the differing elements (infinite when one side is NaN or the two
    /// are infinities of opposite signs).
    pub max_abs_diff: f64,
    /// Index (one coordinate per axis) of the first differing element in row-major order.
    pub first_index: Vec<u64>,
}

/// One way a tensor differs.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum TensorDifference {
    /// Only the first checkpoint has it.
    OnlyInA,
    /// Only the second checkpoint has it.
    OnlyInB,
    /// The element types differ (values are still compared, as f64, when the shapes agree).
    DType {
        /// In the first checkpoint.
        a: DType,
        /// In the second.
        b: DType,
    },
    /// The global shapes differ (values are not compared).
    Shape {
        /// In the first checkpoint.
        a: Vec<u64>,
        /// In the second.
        b: Vec<u64>,
    },
    /// Some elements differ.
    Values(ValueDiff),
}

/// A tensor that differs, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorDiff {
    /// Global key.
    pub key: String,
    /// Every difference found (a dtype difference may come with a value difference).
    pub differences: Vec<TensorDifference>,
}

/// One way a sharded object differs.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ObjectDifference {
    /// Only the first checkpoint has it.
    OnlyInA,
    /// Only the second checkpoint has it.
    OnlyInB,
    /// The grids of shards differ (payloads are not compared).
    Grid {
        /// In the first checkpoint.
        a: Vec<u64>,
        /// In the second.
        b: Vec<u64>,
    },
    /// These shards (grid positions) hold different bytes, or are stored on one side only.
    Shards(Vec<Vec<u64>>),
}

/// A sharded object that differs, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectDiff {
    /// Global key.
    pub key: String,
    /// How it differs.
    pub difference: ObjectDifference,
}

/// A common-state value present on one side only, or different.
#[derive(Debug, Clone, PartialEq)]
pub struct CommonDiff {
    /// Path in the state tree.
    pub path: StatePath,
    /// The value in the first checkpoint, if any.
    pub a: Option<Value>,
    /// The value in the second checkpoint, if any.
    pub b: Option<Value>,
}

/// Outcome of [`diff`]: equal when every list is empty (see [`DiffReport::is_equal`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DiffReport {
    /// Tensors present in both checkpoints.
    pub tensors_compared: usize,
    /// Bytes of tensor data compared (both sides).
    pub bytes_compared: u64,
    /// Sharded objects present in both checkpoints.
    pub objects_compared: usize,
    /// Tensors that differ, by key.
    pub tensors: Vec<TensorDiff>,
    /// Sharded objects that differ, by key.
    pub objects: Vec<ObjectDiff>,
    /// Common-state values that differ, by path.
    pub common: Vec<CommonDiff>,
    /// The content metadata of both, when it differs.
    pub content_metadata: Option<(Value, Value)>,
}

impl DiffReport {
    /// True when nothing differs.
    pub fn is_equal(&self) -> bool {
        self.tensors.is_empty() && self.objects.is_empty() && self.common.is_empty() && self.content_metadata.is_none()
    }
}

impl fmt::Display for TensorDifference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TensorDifference::OnlyInA => f.write_str("only in A"),
            TensorDifference::OnlyInB => f.write_str("only in B"),
            TensorDifference::DType { a, b } => write!(f, "dtype {a} vs {b}"),
            TensorDifference::Shape { a, b } => write!(f, "shape {a:?} vs {b:?}"),
            TensorDifference::Values(v) => write!(
                f,
                "{} element(s) differ, max |a - b| = {}, first at {:?}",
                v.count, v.max_abs_diff, v.first_index
            ),
        }
    }
}

impl fmt::Display for ObjectDifference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ObjectDifference::OnlyInA => f.write_str("only in A"),
            ObjectDifference::OnlyInB => f.write_str("only in B"),
            ObjectDifference::Grid { a, b } => write!(f, "grid {a:?} vs {b:?}"),
            ObjectDifference::Shards(s) => write!(f, "{} shard(s) differ, first {:?}", s.len(), s[0]),
        }
    }
}

impl fmt::Display for CommonDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = path_string(&self.path);
        let show = |v: &Value| v.to_json().to_string();
        match (&self.a, &self.b) {
            (Some(a), Some(b)) => write!(f, "{path}: {} vs {}", show(a), show(b)),
            (Some(a), None) => write!(f, "{path}: only in A ({})", show(a)),
            (None, Some(b)) => write!(f, "{path}: only in B ({})", show(b)),
            (None, None) => write!(f, "{path}"),
        }
    }
}

/// Plain values equal, floats compared by value with NaN equal to NaN.
fn values_equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Float(x), Value::Float(y)) => x == y || (x.is_nan() && y.is_nan()),
        (Value::List(x), Value::List(y)) => x.len() == y.len() && x.iter().zip(y).all(|(a, b)| values_equal(a, b)),
        (Value::Map(x), Value::Map(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|((ka, a), (kb, b))| ka == kb && values_equal(a, b))
        }
        _ => a == b,
    }
}

/// Differences found so far in the values of one tensor.
#[derive(Default)]
struct Acc {
    count: u64,
    max: f64,
    first: Option<u64>,
}

impl Acc {
    fn add(&mut self, flat: u64, d: f64) {
        self.count += 1;
        if d > self.max || d.is_nan() {
            self.max = d;
        }
        self.first.get_or_insert(flat);
    }
}

/// `|a − b|` for two elements that differ (infinite when exactly one is NaN).
fn abs_diff(a: f64, b: f64) -> f64 {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => 0.0,
        (false, false) => (a - b).abs(),
        _ => f64::INFINITY,
    }
}

/// Elements decoded per block when comparing through f64.
const BLOCK: usize = 4096;

/// Compares two runs of elements, the first being element `base` of the tensor.
fn compare(a: &[u8], da: DType, b: &[u8], db: DType, atol: f64, base: u64, acc: &mut Acc) {
    let (sa, sb) = (da.size(), db.size());
    if atol == 0.0 && da == db {
        if a == b {
            return;
        }
        for (k, (x, y)) in a.chunks_exact(sa).zip(b.chunks_exact(sb)).enumerate() {
            if x != y {
                acc.add(base + k as u64, abs_diff(element_to_f64(x, da), element_to_f64(y, db)));
            }
        }
        return;
    }
    let (mut xs, mut ys) = (vec![0.0; BLOCK], vec![0.0; BLOCK]);
    for (i, (ca, cb)) in a.chunks(BLOCK * sa).zip(b.chunks(BLOCK * sb)).enumerate() {
        let n = ca.len() / sa;
        elements_to_f64(ca, da, &mut xs[..n]);
        elements_to_f64(cb, db, &mut ys[..n]);
        for (k, (&x, &y)) in xs[..n].iter().zip(&ys[..n]).enumerate() {
            let equal = x == y || (x - y).abs() <= atol || (x.is_nan() && y.is_nan());
            if !equal {
                acc.add(base + (i * BLOCK + k) as u64, abs_diff(x, y));
            }
        }
    }
}

/// Row-major coordinates of element `flat` of a tensor of `shape`.
fn unravel(mut flat: u64, shape: &[u64]) -> Vec<u64> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        if shape[d] > 0 {
            idx[d] = flat % shape[d];
            flat /= shape[d];
        }
    }
    idx
}

/// A part of a pair of tensors compared: (pair, flat position of the part's first element, the
/// part on each side).
type DiffPart<'i> = (usize, u64, TensorPart<'i>, TensorPart<'i>);

/// Compares the checkpoints in `a` and `b` (any formats [`open`](crate::open) recognises): which
/// tensors and sharded objects are on one side only, dtype and shape differences, element
/// values (see [`DiffOptions::atol`]) with the largest difference and the first differing
/// element per tensor, object payloads shard by shard (as the objects they encode: one object
/// stored by two formats is equal), the common state leaf by leaf, and the content metadata
/// (values compared through the shapes formats give them: see `compared_common`). Tensors are read in slices of rows, both sides at once, the next slices
/// being read while the previous are compared.
///
/// ```
/// use tessera::{save, SaveOptions};
/// use tessera::tools::diff::{diff, DiffOptions, TensorDifference};
/// use tessera::{DType, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
///
/// let ckpt = |w: Vec<f32>| -> tessera::Result<MemoryStorage> {
///     let s = MemoryStorage::new();
///     let bytes = w.iter().flat_map(|x| x.to_le_bytes()).collect();
///     let t = ShardedTensor::full("w", DType::F32, &[w.len() as u64], TensorData::Owned(bytes));
///     save(StateTree::map().with("w", StateTree::Tensor(t)), &s, &SoloComm, &SaveOptions::default())?;
///     Ok(s)
/// };
/// let (a, b) = (ckpt(vec![1.0, 2.0, 3.0])?, ckpt(vec![1.0, 2.5, 3.0])?);
/// assert!(diff(&a, &a, &DiffOptions::default())?.is_equal());
///
/// let report = diff(&a, &b, &DiffOptions::default())?;
/// assert_eq!(report.tensors[0].key, "w");
/// let TensorDifference::Values(v) = &report.tensors[0].differences[0] else { panic!() };
/// assert_eq!((v.count, v.max_abs_diff, v.first_index.as_slice()), (1, 0.5, &[1][..]));
/// // Within a tolerance of 0.5, they are equal.
/// assert!(diff(&a, &b, &DiffOptions { atol: 0.5, ..DiffOptions::default() })?.is_equal());
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn diff(a: &dyn Storage, b: &dyn Storage, opts: &DiffOptions) -> Result<DiffReport> {
    if opts.atol.is_nan() || opts.atol < 0.0 {
        return Err(Error::invalid(format!("the tolerance must be a non-negative number, got {}", opts.atol)));
    }
    let (ca, cb) = (open_checkpoint(a)?, open_checkpoint(b)?);
    check_memory_budget(opts.memory_budget, &ca.index, &a.location())?;
    check_memory_budget(opts.memory_budget, &cb.index, &b.location())?;
    let (ia, ib) = (&ca.index, &cb.index);
    let (a, b) = (ca.storage(), cb.storage());
    let wanted: Option<BTreeSet<&str>> = opts.keys.as_ref().map(|ks| ks.iter().map(String::as_str).collect());
    if let Some(ks) = &wanted {
        let known = |i: &CheckpointIndex, k: &str| i.tensor(k).is_some() || i.object(k).is_some();
        if let Some(k) = ks.iter().find(|k| !known(ia, k) && !known(ib, k)) {
            return Err(Error::not_found(format!("{} and {}: key {k:?}", a.location(), b.location())));
        }
    }
    let selected = |k: &str| wanted.as_ref().is_none_or(|ks| ks.contains(k));
    let mut report = DiffReport::default();

    // Tensors: keys, dtypes and shapes from the indexes.
    let ta: BTreeMap<&str, &TensorEntry> =
        ia.tensors.iter().filter(|t| selected(&t.key)).map(|t| (t.key.as_str(), t)).collect();
    let tb: BTreeMap<&str, &TensorEntry> =
        ib.tensors.iter().filter(|t| selected(&t.key)).map(|t| (t.key.as_str(), t)).collect();
    let mut diffs: BTreeMap<&str, Vec<TensorDifference>> = BTreeMap::new();
    let mut pairs: Vec<(&TensorEntry, &TensorEntry)> = Vec::new();
    for (&key, &x) in &ta {
        let Some(&y) = tb.get(key) else {
            diffs.entry(key).or_default().push(TensorDifference::OnlyInA);
            continue;
        };
        report.tensors_compared += 1;
        if x.dtype != y.dtype {
            diffs.entry(key).or_default().push(TensorDifference::DType { a: x.dtype, b: y.dtype });
        }
        if x.global_shape != y.global_shape {
            diffs
                .entry(key)
                .or_default()
                .push(TensorDifference::Shape { a: x.global_shape.clone(), b: y.global_shape.clone() });
        } else {
            pairs.push((x, y));
        }
    }
    for &key in tb.keys().filter(|k| !ta.contains_key(*k)) {
        diffs.entry(key).or_default().push(TensorDifference::OnlyInB);
    }

    // Values: both sides in the same row slices.
    let per_job = job_bytes(opts.memory_budget);
    // Parts are made as the reader gets to them (a huge tensor is never split up front).
    let parts = pairs.iter().enumerate().flat_map(move |(i, &(x, y))| {
        let elem = (x.dtype.size() + y.dtype.size()) as u64;
        let zeros = vec![0; x.global_shape.len()];
        split_box_lazy(&zeros, &x.global_shape, None, per_job / elem).scan(0u64, move |base, part| {
            let at = *base;
            *base += part.numel();
            Some((i, at, TensorPart { tensor: x, part: part.clone() }, TensorPart { tensor: y, part }))
        })
    });
    let cost_of = |(_, _, p, q): &DiffPart<'_>| p.nbytes() + q.nbytes();
    report.bytes_compared = pairs.iter().fold(0u64, |a, (x, y)| {
        let n = x.global_shape.iter().fold(1u64, |a, &d| a.saturating_mul(d));
        a.saturating_add(n.saturating_mul((x.dtype.size() + y.dtype.size()) as u64))
    });
    let jobs = batched(parts, per_job, cost_of);
    let load_opts = LoadOptions { threads: opts.threads, ..Default::default() };
    let read = |batch: &Vec<DiffPart<'_>>| -> Result<(Vec<u8>, Vec<u8>)> {
        let side = |index: &CheckpointIndex, storage: &dyn Storage, first: bool| -> Result<Vec<u8>> {
            let refs: Vec<&TensorPart<'_>> = batch.iter().map(|(_, _, p, q)| if first { p } else { q }).collect();
            let mut buf = vec![0u8; refs.iter().map(|p| p.nbytes()).sum::<u64>() as usize];
            load_parts(index, storage, &refs, &mut buf, &load_opts)?;
            Ok(buf)
        };
        Ok((side(ia, a, true)?, side(ib, b, false)?))
    };
    let mut accs: Vec<Acc> = pairs.iter().map(|_| Acc::default()).collect();
    let mut write = |job: &Vec<DiffPart<'_>>, (da, db): (Vec<u8>, Vec<u8>)| -> Result<()> {
        let (mut at_a, mut at_b) = (0usize, 0usize);
        for (i, base, p, q) in job {
            let (la, lb) = (p.nbytes() as usize, q.nbytes() as usize);
            let (x, y) = pairs[*i];
            compare(&da[at_a..at_a + la], x.dtype, &db[at_b..at_b + lb], y.dtype, opts.atol, *base, &mut accs[*i]);
            at_a += la;
            at_b += lb;
        }
        Ok(())
    };
    pipeline(jobs, opts.memory_budget, |j| j.iter().map(cost_of).sum(), read, &mut write)?;
    for ((x, _), acc) in pairs.iter().zip(accs) {
        if let Some(first) = acc.first {
            diffs.entry(x.key.as_str()).or_default().push(TensorDifference::Values(ValueDiff {
                count: acc.count,
                max_abs_diff: acc.max,
                first_index: unravel(first, &x.global_shape),
            }));
        }
    }
    report.tensors =
        diffs.into_iter().map(|(key, differences)| TensorDiff { key: key.to_string(), differences }).collect();

    // Sharded objects.
    let oa: BTreeMap<&str, &ObjectEntry> =
        ia.objects.iter().filter(|o| selected(&o.key)).map(|o| (o.key.as_str(), o)).collect();
    let ob: BTreeMap<&str, &ObjectEntry> =
        ib.objects.iter().filter(|o| selected(&o.key)).map(|o| (o.key.as_str(), o)).collect();
    let keys: BTreeSet<&str> = oa.keys().chain(ob.keys()).copied().collect();
    let mut both: Vec<(&ObjectEntry, &ObjectEntry)> = Vec::new();
    for key in keys {
        let difference = match (oa.get(key), ob.get(key)) {
            (Some(_), None) => ObjectDifference::OnlyInA,
            (None, Some(_)) => ObjectDifference::OnlyInB,
            (Some(x), Some(y)) => {
                report.objects_compared += 1;
                if x.global_shape != y.global_shape {
                    ObjectDifference::Grid { a: x.global_shape.clone(), b: y.global_shape.clone() }
                } else {
                    both.push((x, y));
                    continue;
                }
            }
            (None, None) => continue,
        };
        report.objects.push(ObjectDiff { key: key.to_string(), difference });
    }
    // Payloads, a few objects at a time (one load call per side and batch).
    let object_costs: Vec<u64> =
        both.iter().map(|(x, y)| x.shards.iter().chain(&y.shards).map(|s| s.len).sum()).collect();
    for range in batches(&object_costs, per_job, |_| false) {
        let batch = &both[range];
        let pa = object_payloads(ia, a, batch.iter().map(|(x, _)| *x))?;
        let pb = object_payloads(ib, b, batch.iter().map(|(_, y)| *y))?;
        for (x, _) in batch {
            let (sa, sb) = (&pa[x.key.as_str()], &pb[x.key.as_str()]);
            let cells: BTreeSet<&Vec<u64>> = sa.keys().chain(sb.keys()).collect();
            let same = |c: &Vec<u64>| match (sa.get(c), sb.get(c)) {
                (Some(x), Some(y)) => x == y || held(x) == held(y),
                _ => false,
            };
            let differing: Vec<Vec<u64>> = cells.into_iter().filter(|c| !same(c)).cloned().collect();
            if !differing.is_empty() {
                report.objects.push(ObjectDiff { key: x.key.clone(), difference: ObjectDifference::Shards(differing) });
            }
        }
    }
    report.objects.sort_by(|p, q| p.key.cmp(&q.key));

    // Common state and content metadata (whole-checkpoint comparisons only).
    if wanted.is_none() {
        let (ca, ma) = compared_common(ia);
        let (cb, mb) = compared_common(ib);
        let paths: BTreeSet<&StatePath> = ca.keys().chain(cb.keys()).collect();
        for path in paths {
            let (x, y) = (ca.get(path), cb.get(path));
            let same = matches!((x, y), (Some(x), Some(y)) if values_equal(x, y));
            if !same {
                report.common.push(CommonDiff { path: path.clone(), a: x.cloned(), b: y.cloned() });
            }
        }
        if !values_equal(&ma, &mb) {
            report.content_metadata = Some((ma, mb));
        }
    }
    Ok(report)
}

/// The common state of `index` as compared, one entry per leaf, and its content metadata.
/// Formats hold one state in different shapes, and a comparison sees through them:
/// - a value is split into its leaves (dicts and lists descended into; an empty one is a leaf),
///   so a list stored whole equals the same list stored element by element;
/// - a value held as `torch.save` bytes without tensors compares as what it decodes to (plain,
///   or rendered as plain data as a foreign common state is), so an object equals the same
///   object read from another format; one holding tensors compares by its bytes;
/// - without content metadata, the common value `content_metadata` is the content metadata
///   (where Megatron keeps it, and a torch_dist checkpoint has it).
fn compared_common(index: &CheckpointIndex) -> (BTreeMap<StatePath, Value>, Value) {
    let key = PathSeg::Key("content_metadata".into());
    let is_metadata = |p: &StatePath| p.first() == Some(&key);
    let mut metadata = index.content_metadata.clone();
    let moved = metadata == Value::Null && index.common.iter().any(|(p, _)| is_metadata(p));
    let mut leaves = BTreeMap::new();
    let mut moved_leaves = Vec::new();
    for (path, v) in &index.common {
        let mut at = path.clone();
        if moved && is_metadata(path) {
            moved_leaves.push((path[1..].to_vec(), decoded(v)));
        } else {
            split_leaves(&mut at, &decoded(v), &mut leaves);
        }
    }
    if moved {
        metadata = match moved_leaves.as_slice() {
            [(rest, v)] if rest.is_empty() => v.clone(),
            // Given leaf by leaf; paths that do not make one value (never written so) compare
            // as no value.
            _ => assemble(&moved_leaves).unwrap_or(Value::Null),
        };
    }
    (leaves, metadata)
}

/// `v` with each value held as `torch.save` bytes (and holding no tensor) replaced by what it
/// decodes to; bytes that do not decode stay as they are.
fn decoded(v: &Value) -> Value {
    if let Some(bytes) = torch_blob(v) {
        let plain = zip_entries(bytes).ok().filter(|es| !es.iter().any(|e| e.inner_name().starts_with("data/")));
        return match plain.and_then(|_| decode_archive(bytes, "common value").ok()) {
            Some(p) => common_value(&p),
            None => v.clone(),
        };
    }
    match v {
        Value::Map(kv) => Value::Map(kv.iter().map(|(k, x)| (k.clone(), decoded(x))).collect()),
        Value::List(xs) => Value::List(xs.iter().map(decoded).collect()),
        other => other.clone(),
    }
}

/// The leaves of `v` at `path`, into `out`.
fn split_leaves(path: &mut StatePath, v: &Value, out: &mut BTreeMap<StatePath, Value>) {
    match v {
        Value::Map(kv) if !kv.is_empty() && torch_blob(v).is_none() => {
            for (k, x) in kv {
                path.push(PathSeg::Key(k.clone()));
                split_leaves(path, x, out);
                path.pop();
            }
        }
        Value::List(xs) if !xs.is_empty() => {
            for (i, x) in xs.iter().enumerate() {
                path.push(PathSeg::Index(i as u64));
                split_leaves(path, x, out);
                path.pop();
            }
        }
        _ => {
            out.insert(path.clone(), v.clone());
        }
    }
}

/// What an object payload holds, for comparison across the encodings of one object (the
/// payload tags of FORMAT.md): a plain value, whatever encoding holds it (`TSV1`, a
/// `torch.save` archive of plain data, bytes stored untagged, which a DCP copy keeps as a
/// Python `bytes`); otherwise the decoded pickle and its storages.
#[derive(PartialEq)]
enum Held {
    Plain(ComparedValue),
    Pickled(PickleValue, Vec<(String, Vec<u8>)>),
    Undecodable(Vec<u8>),
}

/// A plain value compared as [`values_equal`] does.
struct ComparedValue(Value);

impl PartialEq for ComparedValue {
    fn eq(&self, other: &Self) -> bool {
        values_equal(&self.0, &other.0)
    }
}

fn held(payload: &[u8]) -> Held {
    let (tag, body) = payload.split_at(payload.len().min(4));
    let pickled = |unwrap: bool| -> Held {
        let Ok(mut v) = decode_archive(body, "object payload") else { return Held::Undecodable(payload.to_vec()) };
        if unwrap {
            match v {
                PickleValue::List(mut xs) if xs.len() == 1 => v = xs.pop().expect("one element"),
                _ => return Held::Undecodable(payload.to_vec()),
            }
        }
        match v.to_plain() {
            Some(p) => Held::Plain(ComparedValue(p)),
            None => {
                let entries = zip_entries(body).unwrap_or_default();
                let storages = entries
                    .iter()
                    .filter_map(|e| {
                        let key = e.inner_name().strip_prefix("data/")?;
                        Some((
                            key.to_string(),
                            body[e.data_offset as usize..(e.data_offset + e.size) as usize].to_vec(),
                        ))
                    })
                    .collect();
                Held::Pickled(v, storages)
            }
        }
    };
    if tag == OBJECT_TAG_VALUE {
        match Value::from_bytes(body) {
            Ok(v) => Held::Plain(ComparedValue(v)),
            Err(_) => Held::Undecodable(payload.to_vec()),
        }
    } else if tag == OBJECT_TAG_TORCH {
        pickled(false)
    } else if tag == OBJECT_TAG_TORCH_LIST {
        pickled(true)
    } else {
        Held::Plain(ComparedValue(Value::Bytes(payload.to_vec())))
    }
}

/// Payloads of the shards of some objects: by key, then grid position.
type Payloads<'e> = BTreeMap<&'e str, BTreeMap<Vec<u64>, Vec<u8>>>;

/// The payload of every shard of `objects`, through the generic object-reading path.
fn object_payloads<'e>(
    index: &CheckpointIndex,
    storage: &dyn Storage,
    objects: impl Iterator<Item = &'e ObjectEntry>,
) -> Result<Payloads<'e>> {
    let mut out: Payloads<'e> = BTreeMap::new();
    for o in objects {
        let shards = out.entry(o.key.as_str()).or_default();
        for s in &o.shards {
            shards.insert(s.offset.clone(), read_object(index, storage, &o.key, &s.offset, true)?);
        }
    }
    Ok(out)
}
