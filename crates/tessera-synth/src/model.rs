//! The model of `tessera demo` and of the benchmarks (`tessera-bench`): a GPT-like transformer
//! with Adam state, described for any of the parallel layouts they use, with contents that are
//! a pure function of (key, global element index) so that any loaded layout can be checked byte
//! by byte.
//!
//! Global tensors (L layers, hidden H, SwiGLU width F, vocab V; parameters bf16):
//!
//! | key                                               | shape      | TP split |
//! |---------------------------------------------------|------------|----------|
//! | `embedding.word_embeddings.weight`                | [V, H]     | axis 0   |
//! | `decoder.layers.self_attention.linear_qkv.weight` | [L, 3H, H] | axis 1   |
//! | `decoder.layers.self_attention.linear_proj.weight`| [L, H, H]  | axis 2   |
//! | `decoder.layers.mlp.fc1_w`, `…fc1_v` (fused)       | [L, F, H]  | axis 1   |
//! | `decoder.layers.mlp.linear_fc2.weight`            | [L, H, F]  | axis 2   |
//! | `decoder.layers.{input,pre_mlp}_layernorm.weight` | [L, H]     | replicated |
//! | `decoder.final_layernorm.weight`                  | \[H\]      | replicated |
//!
//! plus `optimizer.exp_avg.<key>` and `optimizer.exp_avg_sq.<key>` in f32 for every parameter,
//! an `rng_state` object with one shard per training rank, and common values.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tessera::factory::{PartSpec, ShardedTensorFactory, SplitFactory};
use tessera::DType;
use tessera::{PathSeg, ReplicaId, ShardedObject, ShardedTensor, StateTree, TensorData, Value};

use crate::progress::Progress;

/// Element type of the parameters.
pub const PARAM_DTYPE: DType = DType::BF16;
/// Element type of the optimizer state.
pub const OPT_DTYPE: DType = DType::F32;
/// The two Adam moments saved per parameter.
pub const MOMENTS: [&str; 2] = ["exp_avg", "exp_avg_sq"];
/// Key of the fused fc1 factory (the merged tensor a load returns).
pub const FC1_KEY: &str = "decoder.layers.mlp.linear_fc1.weight";
/// Key of the per-rank RNG object.
pub const RNG_KEY: &str = "rng_state";

/// Dimensions of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelConfig {
    /// Vocabulary size V.
    pub vocab: u64,
    /// Hidden size H.
    pub hidden: u64,
    /// Width F of each SwiGLU half.
    pub ffn: u64,
    /// Number of layers L.
    pub layers: u64,
}

impl ModelConfig {
    /// A model whose parameters and Adam state (2 + 4 + 4 bytes per parameter) take about
    /// `target` bytes. 8 layers; the layers hold ~85% of the parameters, the embedding the rest.
    /// H is a multiple of 16 and V of 64, so TP degrees up to 16 split every axis evenly.
    pub fn for_bytes(target: u64) -> Self {
        let layers = 8u64;
        let params = (target / 10).max(1);
        let h = (0.85 * params as f64 / (13.0 * layers as f64)).sqrt();
        let hidden = ((h / 16.0).floor() as u64).max(1) * 16;
        let ffn = 3 * hidden;
        let per_layer = 4 * hidden * hidden + 3 * ffn * hidden + 2 * hidden;
        let rest = params.saturating_sub(layers * per_layer + hidden);
        let vocab = ((rest / hidden + 32) / 64).max(1) * 64;
        ModelConfig { vocab, hidden, ffn, layers }
    }

    /// Number of parameters.
    pub fn param_count(&self) -> u64 {
        params(self).iter().map(|p| p.numel(self)).sum()
    }

    /// Bytes of parameters plus optimizer state (what a checkpoint holds, objects aside).
    pub fn state_bytes(&self) -> u64 {
        self.param_count() * (PARAM_DTYPE.size() + 2 * OPT_DTYPE.size()) as u64
    }
}

/// A parameter of the model.
#[derive(Debug, Clone)]
pub struct ParamDef {
    /// Name in the state tree.
    pub name: &'static str,
    /// Global key.
    pub key: &'static str,
    /// Shape of one layer's tensor (stacked) or of the whole tensor.
    pub shape: Vec<u64>,
    /// One tensor per layer, stacked along a prepended global axis.
    pub stacked: bool,
    /// Axis of `shape` split by tensor parallelism (`None`: replicated over TP).
    pub tp_axis: Option<usize>,
    /// Part of the fused SwiGLU fc1 weight.
    pub fused: bool,
}

impl ParamDef {
    /// Global shape.
    pub fn global_shape(&self, cfg: &ModelConfig) -> Vec<u64> {
        let mut g = if self.stacked { vec![cfg.layers] } else { Vec::new() };
        g.extend_from_slice(&self.shape);
        g
    }
    fn numel(&self, cfg: &ModelConfig) -> u64 {
        self.global_shape(cfg).iter().product()
    }
}

/// The parameters, in state-tree order (the two fc1 halves are adjacent).
pub fn params(cfg: &ModelConfig) -> Vec<ParamDef> {
    let (v, h, f) = (cfg.vocab, cfg.hidden, cfg.ffn);
    let p =
        |name, key, shape: Vec<u64>, stacked, tp_axis, fused| ParamDef { name, key, shape, stacked, tp_axis, fused };
    vec![
        p("embedding", "embedding.word_embeddings.weight", vec![v, h], false, Some(0), false),
        p("qkv", "decoder.layers.self_attention.linear_qkv.weight", vec![3 * h, h], true, Some(0), false),
        p("proj", "decoder.layers.self_attention.linear_proj.weight", vec![h, h], true, Some(1), false),
        p("fc1_w", "decoder.layers.mlp.fc1_w", vec![f, h], true, Some(0), true),
        p("fc1_v", "decoder.layers.mlp.fc1_v", vec![f, h], true, Some(0), true),
        p("fc2", "decoder.layers.mlp.linear_fc2.weight", vec![h, f], true, Some(1), false),
        p("input_layernorm", "decoder.layers.input_layernorm.weight", vec![h], true, None, false),
        p("pre_mlp_layernorm", "decoder.layers.pre_mlp_layernorm.weight", vec![h], true, None, false),
        p("final_layernorm", "decoder.final_layernorm.weight", vec![h], false, None, false),
    ]
}

/// Key of an optimizer moment of parameter `key`.
pub fn moment_key(moment: &str, key: &str) -> String {
    format!("optimizer.{moment}.{key}")
}

/// A region of a global tensor held in one buffer: a box (prepended axes of size 1 included),
/// or a `[start, end)` range of the box's row-major flattening.
#[derive(Debug, Clone, PartialEq)]
pub struct Region {
    /// Global key.
    pub key: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub global_shape: Vec<u64>,
    /// Box offset.
    pub offset: Vec<u64>,
    /// Box shape (with prepended axes).
    pub shape: Vec<u64>,
    /// Leading axes absent from the local tensor.
    pub prepend: usize,
    /// Flattened range of the box held.
    pub flat: Option<(u64, u64)>,
}

impl Region {
    /// Elements held.
    pub fn numel(&self) -> u64 {
        self.flat.map_or_else(|| self.shape.iter().product(), |(s, e)| e - s)
    }

    /// Bytes held.
    pub fn nbytes(&self) -> u64 {
        self.numel() * self.dtype.size() as u64
    }

    /// Shape of the local tensor.
    pub fn local_shape(&self) -> &[u64] {
        &self.shape[self.prepend..]
    }

    /// `key[o0:e0, o1:e1] flat [s, e)`.
    pub fn describe(&self) -> String {
        let ranges: Vec<String> = self.offset.iter().zip(&self.shape).map(|(o, s)| format!("{o}:{}", o + s)).collect();
        let flat = self.flat.map(|(s, e)| format!(" flattened [{s}, {e})")).unwrap_or_default();
        format!("{}[{}]{flat}", self.key, ranges.join(", "))
    }

    /// A sharded tensor describing this region over `data`. Even, aligned tilings are
    /// described with `from_rank_offsets` (their fragmentation is then validated); uneven ones
    /// (possible in `bench` with odd TP degrees) as a plain box. Flattened ranges are applied
    /// with `with_flattened_range`.
    pub fn tensor<'a>(&self, data: TensorData<'a>, replica: ReplicaId) -> tessera::Result<ShardedTensor<'a>> {
        let even = self
            .shape
            .iter()
            .zip(&self.global_shape)
            .zip(&self.offset)
            .all(|((&b, &g), &o)| b > 0 && g % b == 0 && o % b == 0);
        let tensor = if even {
            let offsets: Vec<(usize, u64, u64)> = (0..self.shape.len())
                .filter(|&d| self.shape[d] != self.global_shape[d])
                .map(|d| (d, self.offset[d] / self.shape[d], self.global_shape[d] / self.shape[d]))
                .collect();
            ShardedTensor::from_rank_offsets(&self.key, self.dtype, self.local_shape(), data, &offsets, self.prepend)?
        } else {
            ShardedTensor {
                key: self.key.clone(),
                data,
                dtype: self.dtype,
                local_shape: self.local_shape().to_vec(),
                global_shape: self.global_shape.clone(),
                global_offset: self.offset.clone(),
                axis_fragmentations: None,
                replica_id: ReplicaId::main(),
                prepend_axis_num: self.prepend,
                allow_shape_mismatch: false,
                flattened_range: None,
            }
        };
        let tensor = tensor.with_replica_id(replica);
        Ok(match self.flat {
            Some((s, e)) => tensor.with_flattened_range(s..e),
            None => tensor,
        })
    }
}

/// One leaf of a rank's state tree.
#[derive(Debug, Clone)]
pub enum Leaf {
    /// A sharded tensor.
    Tensor {
        /// Dotted path in the tree.
        path: String,
        /// What it holds.
        region: Region,
        /// Replica id (save).
        replica: ReplicaId,
    },
    /// A fused tensor `[w; v]` saved and loaded through a [`SplitFactory`].
    Fused {
        /// Dotted path in the tree.
        path: String,
        /// Key of the factory (and of the merged tensor on load).
        key: String,
        /// Replica id (save).
        replica: ReplicaId,
        /// The parts, in order along the first local axis.
        parts: Vec<Region>,
    },
    /// A shard of the RNG object.
    Object {
        /// Dotted path in the tree.
        path: String,
        /// Shape of the grid of shards.
        grid: Vec<u64>,
        /// This shard's cell.
        cell: Vec<u64>,
        /// Replica id (save).
        replica: ReplicaId,
    },
    /// A common value.
    Value {
        /// Dotted path in the tree.
        path: String,
        /// The value.
        value: Value,
    },
}

impl Leaf {
    /// Bytes of the buffer this leaf needs, if it holds tensor data.
    pub fn data_len(&self) -> Option<u64> {
        match self {
            Leaf::Tensor { region, .. } => Some(region.nbytes()),
            Leaf::Fused { parts, .. } => Some(parts.iter().map(Region::nbytes).sum()),
            _ => None,
        }
    }

    /// The regions held by this leaf's buffer, with their byte offsets in it.
    pub fn regions(&self) -> Vec<(u64, &Region)> {
        match self {
            Leaf::Tensor { region, .. } => vec![(0, region)],
            Leaf::Fused { parts, .. } => {
                let mut at = 0;
                parts
                    .iter()
                    .map(|p| {
                        let here = at;
                        at += p.nbytes();
                        (here, p)
                    })
                    .collect()
            }
            _ => Vec::new(),
        }
    }

    fn path(&self) -> &str {
        match self {
            Leaf::Tensor { path, .. }
            | Leaf::Fused { path, .. }
            | Leaf::Object { path, .. }
            | Leaf::Value { path, .. } => path,
        }
    }
}

/// A parallel layout of the model over ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Training: tensor parallel × data parallel (TP fastest). Parameters are replicated over
    /// DP; optimizer state is DP-sharded as flattened ranges of each TP-local box (distributed
    /// optimizer). One RNG shard per rank.
    Train {
        /// Tensor-parallel degree.
        tp: u64,
        /// Data-parallel degree.
        dp: u64,
    },
    /// Tensor parallel × pipeline parallel (TP fastest): each stage holds its layers; the
    /// optimizer state is held as full TP boxes.
    TpPp {
        /// Tensor-parallel degree.
        tp: u64,
        /// Pipeline stages.
        pp: u64,
    },
    /// One rank holds everything whole.
    Whole,
}

impl Layout {
    /// Number of ranks.
    pub fn world(&self) -> usize {
        match *self {
            Layout::Train { tp, dp } => (tp * dp) as usize,
            Layout::TpPp { tp, pp } => (tp * pp) as usize,
            Layout::Whole => 1,
        }
    }

    /// `TP=4 × DP=2 (8 ranks)`.
    pub fn describe(&self) -> String {
        match *self {
            Layout::Train { tp, dp } => format!("TP={tp} × DP={dp} ({})", ranks(self.world())),
            Layout::TpPp { tp, pp } => format!("TP={tp} × PP={pp} ({})", ranks(self.world())),
            Layout::Whole => "1 rank, whole tensors".to_string(),
        }
    }

    /// Grid of the RNG object saved in this layout.
    pub fn rng_grid(&self) -> Vec<u64> {
        match *self {
            Layout::Train { tp, dp } => vec![tp, dp],
            Layout::TpPp { tp, pp } => vec![tp, pp],
            Layout::Whole => vec![1, 1],
        }
    }
}

fn ranks(n: usize) -> String {
    if n == 1 {
        "1 rank".into()
    } else {
        format!("{n} ranks")
    }
}

/// `[start, start + len)` of part `i` of `n` elements cut into `k` near-equal parts.
pub fn split_range(n: u64, k: u64, i: u64) -> (u64, u64) {
    let start = n * i / k;
    (start, n * (i + 1) / k - start)
}

/// Cut points `0 = b0 < b1 < … < bk = n` of `n` elements into `k` ranges of roughly equal size
/// whose interior boundaries are jittered (deterministically from `seed`) so they fall
/// anywhere, not on rows — as a distributed optimizer's buffer split does.
pub fn jittered_bounds(n: u64, k: u64, seed: u64) -> Vec<u64> {
    let width = n / (4 * k).max(1);
    let mut b: Vec<u64> = (0..=k)
        .map(|i| {
            let even = n * i / k;
            if i == 0 || i == k || width == 0 {
                return even;
            }
            let jitter = mix(seed ^ i) % (2 * width + 1);
            (even + jitter).saturating_sub(width).min(n)
        })
        .collect();
    for i in 1..b.len() {
        b[i] = b[i].max(b[i - 1]);
    }
    b
}

fn param_path(p: &ParamDef, local_layer: Option<u64>) -> String {
    match local_layer {
        Some(l) if p.fused => format!("layers.{l}.mlp.fc1"),
        Some(l) => format!("layers.{l}.{}", p.name),
        None if p.stacked => format!("layers.{}", p.name),
        None => p.name.to_string(),
    }
}

/// The TP-local box of `p` on TP rank `r` of `tp`, for global layer `layer` (stacked params).
fn tp_box(cfg: &ModelConfig, p: &ParamDef, tp: u64, r: u64, layer: Option<u64>) -> Region {
    let mut offset: Vec<u64> = vec![0; p.shape.len()];
    let mut shape = p.shape.clone();
    if let Some(a) = p.tp_axis {
        let (start, len) = split_range(p.shape[a], tp, r);
        offset[a] = start;
        shape[a] = len;
    }
    let prepend = match layer {
        Some(l) => {
            offset.insert(0, l);
            shape.insert(0, 1);
            1
        }
        None => 0,
    };
    Region {
        key: p.key.to_string(),
        dtype: PARAM_DTYPE,
        global_shape: p.global_shape(cfg),
        offset,
        shape,
        prepend,
        flat: None,
    }
}

fn whole(cfg: &ModelConfig, p: &ParamDef) -> Region {
    let g = p.global_shape(cfg);
    Region {
        key: p.key.to_string(),
        dtype: PARAM_DTYPE,
        offset: vec![0; g.len()],
        shape: g.clone(),
        global_shape: g,
        prepend: 0,
        flat: None,
    }
}

fn moment(region: &Region, moment: &str) -> Region {
    Region { key: moment_key(moment, &region.key), dtype: OPT_DTYPE, ..region.clone() }
}

/// The common (non-sharded) state of the checkpoint.
pub fn common_values(cfg: &ModelConfig) -> Vec<(String, Value)> {
    let int = |x: u64| Value::Int(x as i64);
    let config = Value::Map(vec![
        ("model".into(), "gpt-demo".into()),
        ("layers".into(), int(cfg.layers)),
        ("hidden".into(), int(cfg.hidden)),
        ("ffn".into(), int(cfg.ffn)),
        ("vocab".into(), int(cfg.vocab)),
        ("activation".into(), "swiglu".into()),
        ("params_dtype".into(), "bf16".into()),
        ("tied_embeddings".into(), Value::Bool(false)),
    ]);
    let group = Value::Map(vec![
        ("lr".into(), Value::Float(3e-4)),
        ("betas".into(), Value::List(vec![Value::Float(0.9), Value::Float(0.95)])),
        ("eps".into(), Value::Float(1e-8)),
        ("weight_decay".into(), Value::Float(0.1)),
    ]);
    let tokenizer: Vec<u8> = (0..16u64).map(|i| mix(i ^ 0x70c3) as u8).collect();
    vec![
        ("iteration".into(), Value::Int(1000)),
        ("config".into(), config),
        ("optimizer.param_groups".into(), Value::List(vec![group])),
        ("data.tokenizer_digest".into(), Value::Bytes(tokenizer)),
    ]
}

/// The leaves of `rank`'s state in `layout`. `rng_grid` is the grid of the RNG object as
/// saved (load layouts ask for saved shards: objects are not resharded).
pub fn leaves(cfg: &ModelConfig, layout: Layout, rank: usize, rng_grid: &[u64]) -> Vec<Leaf> {
    let rank = rank as u64;
    let defs = params(cfg);
    let mut out = Vec::new();
    let mut opt: Vec<Leaf> = Vec::new();
    match layout {
        Layout::Train { tp, dp } => {
            let (t, d) = (rank % tp, rank / tp);
            for p in &defs {
                let layers: Vec<Option<u64>> = if p.stacked { (0..cfg.layers).map(Some).collect() } else { vec![None] };
                for l in layers {
                    let region = tp_box(cfg, p, tp, t, l);
                    let replica: ReplicaId =
                        if p.tp_axis.is_some() { [0, d as u32].into() } else { [t as u32, d as u32].into() };
                    push_param(&mut out, p, format!("model.{}", param_path(p, l)), region.clone(), replica);
                    // Distributed optimizer: the TP-local box, flattened, cut across DP ranks.
                    let n = region.numel();
                    let bounds = jittered_bounds(n, dp, key_seed(p.key) ^ l.unwrap_or(0));
                    let (s, e) = (bounds[d as usize], bounds[d as usize + 1]);
                    if s == e {
                        continue;
                    }
                    let opt_replica: ReplicaId = if p.tp_axis.is_some() { [0, 0].into() } else { [t as u32, 0].into() };
                    for m in MOMENTS {
                        let mut r = moment(&region, m);
                        r.flat = (dp > 1).then_some((s, e));
                        let path =
                            format!("optimizer.state.{m}.{}", param_path(&ParamDef { fused: false, ..p.clone() }, l));
                        opt.push(Leaf::Tensor { path, region: r, replica: opt_replica.clone() });
                    }
                }
            }
            out.push(Leaf::Object {
                path: RNG_KEY.into(),
                grid: vec![tp, dp],
                cell: vec![t, d],
                replica: ReplicaId::main(),
            });
        }
        Layout::TpPp { tp, pp } => {
            let (t, s) = (rank % tp, rank / tp);
            let (first, count) = split_range(cfg.layers, pp, s);
            for p in &defs {
                let layers: Vec<Option<u64>> = if p.stacked {
                    (first..first + count).map(Some).collect()
                } else if (p.name == "embedding" && s == 0) || (p.name == "final_layernorm" && s == pp - 1) {
                    vec![None]
                } else {
                    continue;
                };
                for l in layers {
                    let region = tp_box(cfg, p, tp, t, l);
                    let local = l.map(|l| l - first);
                    push_param(
                        &mut out,
                        p,
                        format!("model.{}", param_path(p, local)),
                        region.clone(),
                        ReplicaId::main(),
                    );
                    for m in MOMENTS {
                        let path = format!(
                            "optimizer.state.{m}.{}",
                            param_path(&ParamDef { fused: false, ..p.clone() }, local)
                        );
                        opt.push(Leaf::Tensor { path, region: moment(&region, m), replica: ReplicaId::main() });
                    }
                }
            }
            push_objects(&mut out, rng_grid, rank, layout.world() as u64);
        }
        Layout::Whole => {
            for p in &defs {
                if p.fused {
                    // The fused weight goes through its factory layer by layer, at TP=1.
                    for l in 0..cfg.layers {
                        let region = tp_box(cfg, p, 1, 0, Some(l));
                        push_param(&mut out, p, format!("model.{}", param_path(p, Some(l))), region, ReplicaId::main());
                    }
                } else {
                    push_param(&mut out, p, format!("model.{}", param_path(p, None)), whole(cfg, p), ReplicaId::main());
                }
                for m in MOMENTS {
                    let path =
                        format!("optimizer.state.{m}.{}", param_path(&ParamDef { fused: false, ..p.clone() }, None));
                    opt.push(Leaf::Tensor { path, region: moment(&whole(cfg, p), m), replica: ReplicaId::main() });
                }
            }
            push_objects(&mut out, rng_grid, 0, 1);
        }
    }
    out.extend(opt);
    if matches!(layout, Layout::Train { .. }) {
        out.extend(common_values(cfg).into_iter().map(|(path, value)| Leaf::Value { path, value }));
    }
    out
}

/// Adds a parameter leaf; the two fc1 halves of a layer become one fused leaf.
fn push_param(out: &mut Vec<Leaf>, p: &ParamDef, path: String, region: Region, replica: ReplicaId) {
    if region.numel() == 0 {
        return;
    }
    if !p.fused {
        out.push(Leaf::Tensor { path, region, replica });
        return;
    }
    let open = out.iter_mut().rev().find_map(|leaf| match leaf {
        Leaf::Fused { path: at, parts, .. } if *at == path && parts.len() == 1 => Some(parts),
        _ => None,
    });
    match open {
        Some(parts) => parts.push(region),
        None => out.push(Leaf::Fused { key: FC1_KEY.to_string(), path, replica, parts: vec![region] }),
    }
}

/// Load layouts ask for the saved RNG shards round-robin: cell `c` goes to rank `c % world`.
fn push_objects(out: &mut Vec<Leaf>, grid: &[u64], rank: u64, world: u64) {
    let cells: u64 = grid.iter().product();
    for c in (rank..cells).step_by(world as usize) {
        let mut cell = vec![0; grid.len()];
        let mut rest = c;
        for d in (0..grid.len()).rev() {
            cell[d] = rest % grid[d];
            rest /= grid[d];
        }
        out.push(Leaf::Object {
            path: format!("{RNG_KEY}.{c}"),
            grid: grid.to_vec(),
            cell,
            replica: ReplicaId::main(),
        });
    }
}

/// The saved bytes of the RNG shard at `cell`.
pub fn rng_bytes(cell: &[u64]) -> Vec<u8> {
    let label: Vec<String> = cell.iter().map(u64::to_string).collect();
    let mut out = format!("rng state of rank cell [{}]: ", label.join(", ")).into_bytes();
    let seed = cell.iter().fold(0x5eed_u64, |a, &c| mix(a ^ c));
    out.extend((0..64u64).map(|i| mix(seed ^ i) as u8));
    out
}

// -------------------------------------------------------------------------------------------
// Contents.

/// FNV-1a of a key: the seed of its contents.
pub fn key_seed(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// splitmix64's finalizer.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The value (low bytes used) of global element `g` of the tensor whose key seed is `seed`.
#[inline]
fn element(seed: u64, g: u64) -> u64 {
    mix(seed ^ g.wrapping_mul(0xd6e8_feb8_6659_fd93))
}

/// Calls `f(global_index, local_index, len)` for each run of consecutive elements of the
/// region (row by row along the last axis), in local order.
pub fn for_each_run(r: &Region, mut f: impl FnMut(u64, u64, u64)) {
    let nd = r.shape.len();
    let numel: u64 = r.shape.iter().product();
    let (s, e) = r.flat.unwrap_or((0, numel));
    if nd == 0 {
        if s < e {
            f(0, 0, 1);
        }
        return;
    }
    let mut gstride = vec![1u64; nd];
    for d in (0..nd - 1).rev() {
        gstride[d] = gstride[d + 1] * r.global_shape[d + 1];
    }
    let last = r.shape[nd - 1];
    let mut i = s;
    while i < e {
        let mut rest = i;
        let mut g = 0;
        for d in (0..nd).rev() {
            g += (r.offset[d] + rest % r.shape[d]) * gstride[d];
            rest /= r.shape[d];
        }
        let len = (last - i % last).min(e - i);
        f(g, i - s, len);
        i += len;
    }
}

/// Writes the region's expected contents into `out` (exactly `r.nbytes()` bytes).
pub fn fill(r: &Region, out: &mut [u8]) {
    let seed = key_seed(&r.key);
    let es = r.dtype.size();
    for_each_run(r, |g, local, len| {
        let run = &mut out[(local as usize) * es..(local + len) as usize * es];
        for (j, el) in run.chunks_exact_mut(es).enumerate() {
            el.copy_from_slice(&element(seed, g + j as u64).to_le_bytes()[..es]);
        }
    });
}

/// Compares `buf` with the region's expected contents; describes the first difference.
pub fn check(r: &Region, buf: &[u8]) -> Result<(), String> {
    if buf.len() as u64 != r.nbytes() {
        return Err(format!("{}: buffer holds {} bytes, expected {}", r.describe(), buf.len(), r.nbytes()));
    }
    let seed = key_seed(&r.key);
    let es = r.dtype.size();
    let mut bad = 0u64;
    let mut first: Option<(u64, u64)> = None;
    for_each_run(r, |g, local, len| {
        let run = &buf[(local as usize) * es..(local + len) as usize * es];
        for (j, el) in run.chunks_exact(es).enumerate() {
            if el != &element(seed, g + j as u64).to_le_bytes()[..es] {
                bad += 1;
                first.get_or_insert((g + j as u64, local + j as u64));
            }
        }
    });
    match first {
        None => Ok(()),
        Some((g, local)) => Err(format!(
            "{}: {bad} of {} elements differ; first at global flat index {g} (element {local} of the buffer)",
            r.describe(),
            r.numel()
        )),
    }
}

/// Buffers with the expected contents of every data leaf, in leaf order.
pub fn generate(leaves: &[Leaf], progress: Option<&Progress>) -> Vec<Vec<u8>> {
    leaves
        .iter()
        .filter_map(|leaf| {
            let len = leaf.data_len()?;
            let mut buf = vec![0u8; len as usize];
            for (at, r) in leaf.regions() {
                fill(r, &mut buf[at as usize..(at + r.nbytes()) as usize]);
            }
            if let Some(p) = progress {
                p.add(len);
            }
            Some(buf)
        })
        .collect()
}

/// Target buffers for every data leaf, filled with a poison byte (so they are resident and
/// anything load fails to write shows up).
pub fn alloc_targets(leaves: &[Leaf]) -> Vec<Vec<u8>> {
    leaves.iter().filter_map(|l| l.data_len()).map(|n| vec![0xA5u8; n as usize]).collect()
}

/// Total bytes of the data leaves.
pub fn data_bytes(leaves: &[Leaf]) -> u64 {
    leaves.iter().filter_map(Leaf::data_len).sum()
}

fn segs(dotted: &str) -> Vec<PathSeg> {
    dotted.split('.').map(|s| PathSeg::Key(s.to_string())).collect()
}

/// Builds the state tree of `leaves` over `datas` (one per data leaf, in order). For a save,
/// objects carry their bytes and common values are included; for a load, objects are requests
/// and common values are left for the checkpoint to supply.
pub fn build_tree<'a>(leaves: &[Leaf], datas: Vec<TensorData<'a>>, save: bool) -> tessera::Result<StateTree<'a>> {
    let mut tree = StateTree::map();
    let mut datas = datas.into_iter();
    for leaf in leaves {
        let node = match leaf {
            Leaf::Tensor { region, replica, .. } => {
                StateTree::Tensor(region.tensor(datas.next().expect("one buffer per data leaf"), replica.clone())?)
            }
            Leaf::Fused { key, replica, parts, .. } => {
                let mut fused_shape = parts[0].local_shape().to_vec();
                fused_shape[0] = parts.iter().map(|p| p.local_shape()[0]).sum();
                let spec = |p: &Region| PartSpec {
                    key: p.key.clone(),
                    dtype: p.dtype,
                    local_shape: p.local_shape().to_vec(),
                    global_shape: p.global_shape.clone(),
                    global_offset: p.offset.clone(),
                    prepend_axis_num: p.prepend,
                };
                let names = ["w", "v"];
                let factory = SplitFactory {
                    local_shape: fused_shape,
                    parts: parts.iter().enumerate().map(|(i, p)| (names[i.min(1)].to_string(), spec(p))).collect(),
                };
                StateTree::Factory(ShardedTensorFactory {
                    key: key.clone(),
                    data: datas.next().expect("one buffer per data leaf"),
                    replica_id: replica.clone(),
                    factory: Arc::new(factory),
                })
            }
            Leaf::Object { grid, cell, replica, .. } => {
                let mut o = ShardedObject::new(RNG_KEY, rng_bytes(cell), grid, cell).with_replica_id(replica.clone());
                if !save {
                    o.data = None;
                }
                StateTree::Object(o)
            }
            Leaf::Value { value, .. } => {
                if !save {
                    continue;
                }
                StateTree::Value(value.clone())
            }
        };
        tree.set_path(&segs(leaf.path()), node);
    }
    Ok(tree)
}

/// What a check found.
#[derive(Debug, Default, Clone)]
pub struct CheckReport {
    /// Tensor regions compared.
    pub regions: usize,
    /// Bytes compared.
    pub bytes: u64,
    /// Object shards compared.
    pub objects: usize,
    /// Common values compared.
    pub values: usize,
    /// Everything that did not match.
    pub problems: Vec<String>,
}

impl CheckReport {
    /// Adds another report's counts and problems.
    pub fn merge(&mut self, other: CheckReport) {
        self.regions += other.regions;
        self.bytes += other.bytes;
        self.objects += other.objects;
        self.values += other.values;
        self.problems.extend(other.problems);
    }
}

/// Checks what a load returned besides tensor bytes: merged factory tensors in place, object
/// shards, and the common values (which must all come back from the checkpoint).
pub fn check_tree(state: &StateTree<'_>, leaves: &[Leaf], cfg: &ModelConfig, rank: usize) -> CheckReport {
    let mut rep = CheckReport::default();
    for leaf in leaves {
        match leaf {
            Leaf::Fused { path, key, parts, .. } => match state.get(&segs(path)).and_then(StateTree::as_tensor) {
                Some(t) if t.key == *key && t.data.len() as u64 == leaf.data_len().unwrap_or(0) => {
                    if t.local_shape[0] != parts.iter().map(|p| p.local_shape()[0]).sum::<u64>() {
                        rep.problems.push(format!("rank {rank}: merged {key:?} has local shape {:?}", t.local_shape));
                    }
                }
                Some(t) => rep.problems.push(format!(
                    "rank {rank}: {path}: factory merged into {:?} with {} bytes",
                    t.key,
                    t.data.len()
                )),
                None => rep.problems.push(format!("rank {rank}: {path}: no merged tensor for factory {key:?}")),
            },
            Leaf::Object { path, cell, .. } => {
                rep.objects += 1;
                match state.get(&segs(path)).and_then(StateTree::as_object).and_then(|o| o.data.as_ref()) {
                    Some(d) if *d == rng_bytes(cell) => {}
                    Some(d) => rep.problems.push(format!(
                        "rank {rank}: object {RNG_KEY} shard {cell:?}: {} bytes differ from those saved",
                        d.len()
                    )),
                    None => rep.problems.push(format!("rank {rank}: object {RNG_KEY} shard {cell:?} was not loaded")),
                }
            }
            _ => {}
        }
    }
    for (path, want) in common_values(cfg) {
        rep.values += 1;
        match state.get(&segs(&path)).and_then(StateTree::as_value) {
            Some(v) if *v == want => {}
            Some(v) => rep.problems.push(format!(
                "rank {rank}: common value {path}: got {}, saved {}",
                v.to_json(),
                want.to_json()
            )),
            None => rep.problems.push(format!("rank {rank}: common value {path} missing from the loaded state")),
        }
    }
    rep
}

/// Compares every data leaf's buffer with its expected contents, on all cores.
pub fn check_buffers(items: &[(&Leaf, &[u8])], progress: Option<&Progress>) -> CheckReport {
    let next = AtomicUsize::new(0);
    let total = Mutex::new(CheckReport::default());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(items.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut rep = CheckReport::default();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((leaf, buf)) = items.get(i) else { break };
                    for (at, r) in leaf.regions() {
                        let part = buf.get(at as usize..(at + r.nbytes()) as usize).unwrap_or(&[]);
                        if let Err(e) = check(r, part) {
                            rep.problems.push(e);
                        }
                        rep.regions += 1;
                        rep.bytes += r.nbytes();
                    }
                    if let Some(p) = progress {
                        p.add(buf.len() as u64);
                    }
                }
                total.lock().unwrap().merge(rep);
            });
        }
    });
    total.into_inner().unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(global: &[u64], offset: &[u64], shape: &[u64], flat: Option<(u64, u64)>) -> Region {
        Region {
            key: "t".into(),
            dtype: DType::BF16,
            global_shape: global.to_vec(),
            offset: offset.to_vec(),
            shape: shape.to_vec(),
            prepend: 0,
            flat,
        }
    }

    #[test]
    fn runs_cover_a_box_and_a_flat_range() {
        let mut runs = Vec::new();
        for_each_run(&region(&[4, 6], &[1, 2], &[2, 3], None), |g, l, n| runs.push((g, l, n)));
        assert_eq!(runs, vec![(8, 0, 3), (14, 3, 3)]);
        runs.clear();
        for_each_run(&region(&[4, 6], &[1, 2], &[2, 3], Some((1, 5))), |g, l, n| runs.push((g, l, n)));
        assert_eq!(runs, vec![(9, 0, 2), (14, 2, 2)]);
    }

    #[test]
    fn contents_depend_on_global_position_only() {
        let whole = region(&[4, 6], &[0, 0], &[4, 6], None);
        let mut all = vec![0u8; whole.nbytes() as usize];
        fill(&whole, &mut all);
        let part = region(&[4, 6], &[1, 2], &[2, 3], Some((1, 5)));
        let mut buf = vec![0u8; part.nbytes() as usize];
        fill(&part, &mut buf);
        assert_eq!(&buf[0..4], &all[18..22]);
        assert_eq!(&buf[4..8], &all[28..32]);
        assert!(check(&part, &buf).is_ok());
        buf[5] ^= 1;
        assert!(check(&part, &buf).unwrap_err().contains("1 of 4 elements differ"));
    }

    #[test]
    fn jittered_bounds_are_monotone_and_complete() {
        for n in [0u64, 1, 7, 100, 12345] {
            for k in [1u64, 2, 3, 8] {
                let b = jittered_bounds(n, k, n ^ k);
                assert_eq!(b.len() as u64, k + 1);
                assert_eq!((b[0], b[k as usize]), (0, n));
                assert!(b.windows(2).all(|w| w[0] <= w[1]));
            }
        }
    }

    #[test]
    fn model_size_is_close_to_the_target() {
        for target in [8u64 << 20, 64 << 20, 1 << 30] {
            let cfg = ModelConfig::for_bytes(target);
            let got = cfg.state_bytes() as f64;
            assert!((got / target as f64 - 1.0).abs() < 0.1, "{cfg:?}: {got} for {target}");
        }
    }
}
