//! Memory is bounded by what is on disk: hostile checkpoints of a few KiB that claim (or expand
//! to) gigabytes fail with `Error::Corrupt` naming the file and the key, before allocating what
//! they claim. Every input is built by the test (see `tessera_testkit::hostile`).

use crate::common::hostile;

use std::path::Path;

use crate::common::files::copy_dir;
use crate::common::{shard, TempDir};
use hostile::*;
use tessera::__fuzz::{parse_header, unpickle, PickleValue, UnpickleLimits};
use tessera::comm::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

/// The `Corrupt` error of `r`, or a panic describing what came instead.
fn corrupt<T: std::fmt::Debug>(r: Result<T>) -> (String, String) {
    match r {
        Err(Error::Corrupt { path, reason }) => (path.to_string_lossy().into_owned(), reason),
        other => panic!("expected Error::Corrupt, got {other:?}"),
    }
}

/// Reads the first bytes of the virtual file of `fqn`'s only chunk.
fn read_chunk(dir: &Path, fqn: &str) -> Result<()> {
    let st = LocalStorage::new(dir);
    let ckpt = open(&st)?;
    let t = ckpt.index().tensor(fqn).expect("tensor");
    let name = &ckpt.index().files[t.chunks()[0].file as usize].name;
    let mut buf = [0u8; 16];
    tessera::__fuzz::checkpoint_storage(&ckpt).read_at(name, 0, &mut buf)
}

#[test]
fn dcp_byte_item_claiming_2_40_bytes_is_refused_at_open() {
    let dir = TempDir::new("hostile-bytes");
    write_dcp(dir.path(), &[Item::Bytes { fqn: "extra_state", data: b"tiny".to_vec(), length: Some(1 << 40) }]);
    let (path, reason) = corrupt(open(&LocalStorage::new(dir.path())).map(|_| ()));
    assert!(path.ends_with("__0_0.distcp"), "{path}");
    assert!(reason.contains("\"extra_state\"") && reason.contains("1099511627776"), "{reason}");
    assert!(reason.contains("the file has 4"), "{reason}");
}

#[test]
fn zstd_bomb_stops_at_the_declared_size() {
    let dir = TempDir::new("hostile-zstd");
    // 20,000 RLE blocks: 80 KB that expand to 2.5 GiB, for a tensor of 16 bytes.
    let bomb = zstd_rle_bomb(20_000);
    assert!(bomb.len() < 100_000);
    write_dcp(dir.path(), &[Item::Tensor { fqn: "w", size: vec![4], data: bomb, transforms: vec!["stream.zstd/1"] }]);
    let start = std::time::Instant::now();
    let (path, reason) = corrupt(read_chunk(dir.path(), "w"));
    assert!(path.ends_with("__0_0.distcp"), "{path}");
    assert!(reason.contains("zstd item of \"w\"") && reason.contains("decompresses past"), "{reason}");
    // The cap is the tensor's 16 bytes plus 1 MiB of archive, not a generous slack.
    assert!(reason.contains(&format!("past {} bytes", 16 + (1 << 20))), "{reason}");
    assert!(start.elapsed() < std::time::Duration::from_secs(20), "decoding was not cut short");
    // The whole load path gives the same error.
    let (_, reason) = corrupt(open(&LocalStorage::new(dir.path())).and_then(|c| c.read_tensors(None)));
    assert!(reason.contains("\"w\""), "{reason}");
}

#[test]
fn stride_0_item_cannot_expand_past_its_storage() {
    let dir = TempDir::new("hostile-stride");
    // 2^26 elements (256 MiB) with stride 0 over a 4-byte storage.
    let item = torch_save_tensor(&[1 << 26], &[0], &[0u8; 4]);
    write_dcp(dir.path(), &[Item::Tensor { fqn: "w", size: vec![1 << 26], data: item, transforms: vec![] }]);
    let (path, reason) = corrupt(read_chunk(dir.path(), "w"));
    assert!(path.ends_with("__0_0.distcp"), "{path}");
    assert!(reason.contains("\"w\"") && reason.contains("strided tensor of 268435456 bytes"), "{reason}");
}

#[test]
fn small_expanded_tensors_still_load() {
    // A stride-0 tensor within the slack is legitimate (torch.zeros(1).expand(8)).
    let dir = TempDir::new("hostile-stride-ok");
    let item = torch_save_tensor(&[8], &[0], &1.5f32.to_le_bytes());
    write_dcp(dir.path(), &[Item::Tensor { fqn: "w", size: vec![8], data: item, transforms: vec![] }]);
    let got = open(&LocalStorage::new(dir.path())).and_then(|c| c.read_tensors(None)).unwrap();
    assert_eq!(got["w"].data, 1.5f32.to_le_bytes().repeat(8));
}

/// A native checkpoint of one f32 tensor `w` [4].
fn native(dir: &TempDir) -> LocalStorage {
    let st = LocalStorage::new(dir.path());
    let data = vec![7u8; 16];
    let mut tree = StateTree::map();
    tree.insert(
        "w".to_string(),
        StateTree::Tensor(shard("w", DType::F32, &[4], &[0], &[4], 0, None, TensorData::Ref(&data))),
    );
    save(tree, &st, &SoloComm, &SaveOptions::default()).unwrap();
    st
}

#[test]
fn native_index_head_len_huge() {
    let dir = TempDir::new("hostile-head");
    let st = native(&dir);
    let path = dir.join(INDEX_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[12..20].copy_from_slice(&(1u64 << 60).to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    let (p, reason) = corrupt(open(&st).map(|_| ()));
    assert!(p.ends_with(INDEX_FILE), "{p}");
    assert!(reason.contains("head needs"), "{reason}");
    let (p, _) = corrupt(open(&st).and_then(|c| c.read_tensors(None)));
    assert!(p.ends_with(INDEX_FILE), "{p}");
}

#[test]
fn native_index_header_len_huge() {
    let dir = TempDir::new("hostile-header");
    let st = native(&dir);
    let mut index = open(&st).map(Checkpoint::into_index).unwrap();
    let data_file = index.files[0].name.clone();
    index.files[0].header_len = 1 << 40;
    index.files[0].size = 1 << 41;
    std::fs::write(dir.join(INDEX_FILE), index.encode()).unwrap();
    // The chunks now lie inside the header: the validation gate refuses the index.
    let (p, reason) = corrupt(open(&st).and_then(|c| c.read_tensors(None)));
    assert!(p.ends_with(INDEX_FILE) && reason.contains("outside the data of"), "{p}: {reason}");
    // With the chunks moved past the claimed header, the index passes the gate and verified
    // loads checksum the header: read in pieces, failing at the file's real end.
    let shift = (1u64 << 40) - open_index_unchecked_header(&dir);
    for t in &mut index.tensors {
        let moved: Vec<StoredChunk> =
            t.chunks().iter().map(|c| StoredChunk { byte_offset: c.byte_offset + shift, ..c.clone() }).collect();
        *t = TensorEntry::new(t.key.clone(), t.dtype, t.global_shape.clone(), moved);
    }
    for o in &mut index.objects {
        for s in &mut o.shards {
            s.byte_offset += shift;
        }
    }
    std::fs::write(dir.join(INDEX_FILE), index.encode()).unwrap();
    let (p, reason) = corrupt(open(&st).and_then(|c| c.read_tensors(None)));
    assert!(p.ends_with(&data_file), "{p}: {reason}");
}

/// The real header length of the first data file of the checkpoint in `dir`, from the index
/// as it was saved (before the test edits it, it is still in the data file's own header).
fn open_index_unchecked_header(dir: &TempDir) -> u64 {
    let st = LocalStorage::new(dir.path());
    let name = st.list().unwrap().into_iter().find(|n| n.ends_with(".safetensors")).unwrap();
    let mut read = |off: u64, buf: &mut [u8]| st.read_at(&name, off, buf);
    parse_header(&mut read, st.size(&name).unwrap()).unwrap().1
}

/// The Megatron zarr fixture copied to `dir`, with `key`'s `.zarray` replaced by `zarray`.
fn zarr_with(dir: &TempDir, key: &str, zarray: &str) -> LocalStorage {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/foreign/megatron_zarr");
    copy_dir(&fixture, dir.path());
    std::fs::write(dir.join(key).join(".zarray"), zarray).unwrap();
    LocalStorage::new(dir.path())
}

#[test]
fn zarr_grid_larger_than_its_folder() {
    let key = "decoder.final_norm.weight";
    for (shape, chunks, want) in [
        ("[16777216]", "[1]", "a grid of 16777216 chunks"),
        ("[1099511627776, 1048576]", "[1, 1]", "a grid of 1152921504606846976 chunks"),
        ("[4611686018427387904, 4611686018427387904]", "[1, 1]", "overflows 64 bits"),
    ] {
        let dir = TempDir::new("hostile-zarr");
        let st = zarr_with(
            &dir,
            key,
            &format!(r#"{{"chunks":{chunks},"compressor":null,"dtype":"<f4","shape":{shape},"zarr_format":2}}"#),
        );
        let (p, reason) = corrupt(open(&st).map(|_| ()));
        assert!(p.ends_with(&format!("{key}/.zarray")), "{p}");
        assert!(reason.contains(want) && reason.contains(key), "{reason}");
    }
}

#[test]
fn pickle_memo_sharing_bomb_trips_the_budget() {
    // 1 MiB string shared 4000 times: 1 MiB of input, 4 GiB once copied out.
    let bomb = memo_sharing_bomb(1 << 20, 4000);
    assert!(bomb.len() < (1 << 20) + 10_000);
    let (p, reason) = corrupt(unpickle(&bomb, "bomb.pkl", &UnpickleLimits::default()));
    assert_eq!(p, "bomb.pkl");
    assert!(reason.contains("budget"), "{reason}");
    // As a DCP `.metadata`: the error names the file.
    let dir = TempDir::new("hostile-memo");
    std::fs::create_dir_all(dir.path()).unwrap();
    std::fs::write(dir.join(".metadata"), &bomb).unwrap();
    let (p, reason) = corrupt(open(&LocalStorage::new(dir.path())).map(|_| ()));
    assert!(p.ends_with(".metadata") && reason.contains("budget"), "{p}: {reason}");
}

#[test]
fn pickle_of_millions_of_nones_trips_the_budget() {
    // The 48 M `None`s case, smaller: 4 M (4 MB) would take ~500 MB as values.
    let (p, reason) = corrupt(unpickle(&nones(4_000_000), "nones.pkl", &UnpickleLimits::default()));
    assert_eq!(p, "nones.pkl");
    assert!(reason.contains("budget") && reason.contains("4000006-byte pickle"), "{reason}");
    // Within the floor, lists of Nones are fine.
    assert!(
        matches!(unpickle(&nones(100_000), "ok.pkl", &UnpickleLimits::default()), Ok(PickleValue::List(v)) if v.len() == 100_000)
    );
}

/// A DCP tensor of 2^56 elements (one chunk) whose item is a few bytes.
fn huge_tensor_dcp(dir: &TempDir) -> LocalStorage {
    let side = 1u64 << 28;
    let item = torch_save_tensor(&[side, side], &[side, 1], &[0u8; 64]);
    write_dcp(dir.path(), &[Item::Tensor { fqn: "w", size: vec![side, side], data: item, transforms: vec![] }]);
    LocalStorage::new(dir.path())
}

#[test]
fn unshard_of_a_2_56_element_tensor_is_not_split_up_front() {
    let dir = TempDir::new("hostile-unshard");
    let st = huge_tensor_dcp(&dir);
    let out_dir = TempDir::new("hostile-unshard-out");
    let out = out_dir.join("out.safetensors");
    let opts = ExportOptions { memory_budget: 64 << 20, ..Default::default() };
    // Split up front, 2^56 elements in 16 MiB parts would be 2^34 parts (this test would not
    // finish); lazily, the first part's read fails.
    let (p, reason) = corrupt(export_safetensors(&st, &out, &opts, &mut |_, _| {}));
    assert!(p.ends_with("__0_0.distcp"), "{p}");
    assert!(reason.contains("\"w\""), "{reason}");
}

#[test]
fn convert_of_a_2_56_element_tensor_counts_its_parts_first() {
    let dir = TempDir::new("hostile-convert");
    let st = huge_tensor_dcp(&dir);
    let dst_dir = TempDir::new("hostile-convert-dst");
    let opts = ConvertOptions { memory_budget: 64 << 20, ..Default::default() };
    match convert(&st, &LocalStorage::new(dst_dir.path()), &opts, &mut |_, _| {}) {
        Err(Error::InvalidArgument { reason }) => {
            assert!(reason.contains("\"w\"") && reason.contains("raise the memory budget"), "{reason}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn loading_a_claimed_2_56_element_tensor_whole_is_an_error_not_an_abort() {
    let dir = TempDir::new("hostile-plain");
    let st = huge_tensor_dcp(&dir);
    match open(&st).and_then(|c| c.read_tensors(None)) {
        Err(Error::InvalidArgument { reason }) => {
            assert!(reason.contains("\"w\"") && reason.contains("cannot allocate"), "{reason}")
        }
        other => panic!("expected InvalidArgument, got {:?}", other.map(|m| m.len())),
    }
}

/// The variable that makes a memory test its own child: the directory of the checkpoint the
/// child reads (see `common/rss.rs`).
const RSS_CHILD: &str = "TESSERA_TEST_RSS_CHILD";

/// A native checkpoint in `dir` of one u8 tensor of `len` bytes saved with a checksum per byte
/// (block size 1): its index holds 4 bytes of checksum per byte of data.
fn block_size_1_checkpoint(dir: &TempDir, len: usize) -> LocalStorage {
    let st = LocalStorage::new(dir.path());
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
    let tree = StateTree::map().with(
        "model.layers.0.mlp.weight",
        StateTree::Tensor(ShardedTensor::full(
            "model.layers.0.mlp.weight",
            DType::U8,
            &[len as u64],
            TensorData::Ref(&data),
        )),
    );
    save(tree, &st, &SoloComm, &SaveOptions { block_size: 1, ..SaveOptions::default() }).unwrap();
    st
}

/// Runs `test` (the caller) in a child on a block-size-1 checkpoint of 4 MiB and checks the
/// child's peak RSS against 2 × the checkpoint's size + 64 MiB.
fn block_size_1_within_bound(test: &str, what: &str) {
    let dir = TempDir::new("bs1");
    block_size_1_checkpoint(&dir, 4 << 20);
    child_within_bound(test, what, &dir, &[]);
}

/// Runs `test` (the caller) in a child on the checkpoint in `dir` (with `env` besides) and
/// checks the child's peak RSS against 2 × the checkpoint's size + 64 MiB.
fn child_within_bound(test: &str, what: &str, dir: &TempDir, env: &[(&str, &std::ffi::OsStr)]) {
    let input = dir_size(dir.path());
    let mut all = vec![(RSS_CHILD, dir.path().as_os_str())];
    all.extend_from_slice(env);
    let rss = crate::common::rss::child_peak_rss(&crate::common::test_path(module_path!(), test), &all);
    let limit = crate::common::rss::rss_bound(input);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!("{what}: input {:.1} MiB, peak RSS {:.1} MiB (limit {:.1} MiB)", mib(input), mib(rss), mib(limit));
    assert!(rss <= limit, "{what}: peak RSS {rss} > {limit} for {input} bytes of checkpoint");
}

#[test]
fn verify_of_a_block_size_1_checkpoint_stays_within_2x_input_plus_64_mib() {
    if let Some(dir) = std::env::var_os(RSS_CHILD) {
        let st = LocalStorage::new(dir);
        let report = verify(&st, 2).unwrap();
        assert!(report.problems.is_empty() && report.checksummed, "{:?}", report.problems);
        let file_size = open(&st).unwrap().index().files[0].size;
        assert_eq!(report.bytes_checked, file_size, "the data and its file's header");
        crate::common::rss::report_peak_rss();
        return;
    }
    block_size_1_within_bound("verify_of_a_block_size_1_checkpoint_stays_within_2x_input_plus_64_mib", "verify");
}

#[test]
fn load_of_a_block_size_1_checkpoint_stays_within_2x_input_plus_64_mib() {
    if let Some(dir) = std::env::var_os(RSS_CHILD) {
        let got = open(&LocalStorage::new(dir)).and_then(|c| c.read_tensors(None)).unwrap();
        assert_eq!(got["model.layers.0.mlp.weight"].data.len(), 4 << 20);
        crate::common::rss::report_peak_rss();
        return;
    }
    block_size_1_within_bound("load_of_a_block_size_1_checkpoint_stays_within_2x_input_plus_64_mib", "load");
}

#[test]
fn verify_of_a_block_size_1_checkpoint_reports_each_damaged_block() {
    let dir = TempDir::new("bs1-damage");
    let st = block_size_1_checkpoint(&dir, 100_000);
    let index = open(&st).map(Checkpoint::into_index).unwrap();
    let (file, header) = (&index.files[0].name, index.files[0].header_len);
    let mut bytes = std::fs::read(dir.join(file)).unwrap();
    for at in [0u64, 65_537, 99_999] {
        bytes[(header + at) as usize] ^= 0x40;
    }
    std::fs::write(dir.join(file), &bytes).unwrap();
    let report = verify(&st, 2).unwrap();
    let want: Vec<String> = [0u64, 65_537, 99_999]
        .iter()
        .map(|at| {
            let off = header + at;
            format!(
                "{}/{file}: checksum mismatch in tensor \"model.layers.0.mlp.weight\" at bytes {off}..{}",
                st.location(),
                off + 1
            )
        })
        .collect();
    assert_eq!(report.problems, want);
}

/// Runs `test` (the caller) in a child on a DCP checkpoint whose `.metadata` holds `n` plain
/// values of one opcode `value` each, and checks the child's peak RSS against 2 × the input +
/// 64 MiB.
fn plain_values_within_bound(test: &str, what: &str, n: usize, value: &[u8]) {
    let dir = TempDir::new("plain-values");
    write_dcp_with(dir.path(), P::Dict(vec![(s("w"), P::Tuple(vec![s("w")])), (s("extra"), plain_values(n, value))]));
    child_within_bound(test, what, &dir, &[]);
}

#[test]
fn dcp_metadata_of_millions_of_small_ints_opens_within_2x_input_plus_64_mib() {
    if let Some(dir) = std::env::var_os(RSS_CHILD) {
        // 4 M small ints (8 MB) in the planner's data: read in place, never built as values.
        let got = open(&LocalStorage::new(dir)).and_then(|c| c.read_tensors(None)).unwrap();
        assert_eq!(got["w"].data, vec![0u8; 16]);
        crate::common::rss::report_peak_rss();
        return;
    }
    let test = "dcp_metadata_of_millions_of_small_ints_opens_within_2x_input_plus_64_mib";
    plain_values_within_bound(test, "4 M small ints", 4_000_000, &[b'K', 7]);
}

#[test]
fn dcp_metadata_of_millions_of_nones_is_refused_within_2x_input_plus_64_mib() {
    if let Some(dir) = std::env::var_os(RSS_CHILD) {
        // 4 M Nones (4 MB) would be 250 MB as values: over the unpickler's budget.
        let (path, reason) = corrupt(open(&LocalStorage::new(dir)).map(|_| ()));
        assert!(path.ends_with(".metadata") && reason.contains("budget"), "{path}: {reason}");
        crate::common::rss::report_peak_rss();
        return;
    }
    let test = "dcp_metadata_of_millions_of_nones_is_refused_within_2x_input_plus_64_mib";
    plain_values_within_bound(test, "4 M Nones", 4_000_000, b"N");
}

/// Which budget ratios a real pickle (`TESSERA_BUDGET_PICKLE`, e.g. from
/// `scripts/ci/unpickle_budget.sh`) unpickles under; the default must be one of them.
#[test]
#[ignore = "needs a large pickle: scripts/ci/unpickle_budget.sh"]
fn unpickler_budget_of_real_metadata() {
    let path = std::env::var("TESSERA_BUDGET_PICKLE").expect("TESSERA_BUDGET_PICKLE");
    let bytes = std::fs::read(&path).unwrap();
    for ratio in [8usize, 12, 16, 20, 24, 32, 48] {
        let limits = UnpickleLimits { output_per_input_byte: ratio, output_floor: 1 << 20, ..Default::default() };
        let ok = unpickle(&bytes, &path, &limits).is_ok();
        println!("ratio {ratio}: {} ({} bytes)", if ok { "unpickled" } else { "over budget" }, bytes.len());
    }
    assert!(unpickle(&bytes, &path, &UnpickleLimits::default()).is_ok(), "the default budget refuses {path}");
}

/// Runs `test` (the caller) in a child on the DCP checkpoint torch writes for a flat state
/// dict of `n` non-tensor values (`dcp_byte_items`: a `.metadata` of `n` byte items, about 115
/// bytes each, pointing into 4 small data files) and checks the child's peak RSS against 2 ×
/// the checkpoint's size + 64 MiB.
fn byte_items_within_bound(test: &str, n: usize) {
    let dir = TempDir::new("byte-items");
    let (meta, files) = dcp_byte_items(n, 4, &torch_save_value(&P::Int(7)));
    std::fs::create_dir_all(dir.path()).unwrap();
    std::fs::write(dir.join(".metadata"), &meta).unwrap();
    for (name, bytes) in &files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    drop((meta, files));
    let n_str = n.to_string();
    child_within_bound(test, &format!("{n} byte items"), &dir, &[(BYTE_ITEMS, std::ffi::OsStr::new(&n_str))]);
}

/// The variable that tells a child of [`byte_items_within_bound`] how many items to expect.
const BYTE_ITEMS: &str = "TESSERA_TEST_BYTE_ITEMS";

/// In a child of [`byte_items_within_bound`]: opens the checkpoint, checks it and reports the
/// peak RSS. Each item is read and decoded at open into a common value keyed by its path.
fn open_byte_items(dir: std::ffi::OsString) {
    let n: usize = std::env::var(BYTE_ITEMS).unwrap().parse().unwrap();
    let st = LocalStorage::new(dir);
    let ckpt = open(&st).unwrap();
    let common = &ckpt.index().common;
    assert_eq!(common.len(), n);
    let last = vec![PathSeg::Key(format!("optim.param_groups.{}.lr", n - 1))];
    assert_eq!(common.iter().find(|(p, _)| *p == last).map(|(_, v)| v), Some(&Value::Int(7)));
    assert_eq!(ckpt.index().tensor("w").map(|t| t.chunks().len()), Some(1));
    crate::common::rss::report_peak_rss();
}

#[test]
fn dcp_metadata_of_100_000_byte_items_opens_within_2x_input_plus_64_mib() {
    if let Some(dir) = std::env::var_os(RSS_CHILD) {
        return open_byte_items(dir);
    }
    byte_items_within_bound("dcp_metadata_of_100_000_byte_items_opens_within_2x_input_plus_64_mib", 100_000);
}

#[test]
#[ignore = "over the bound: 1 M byte items (110 MiB of .metadata) peak at 628 MiB (limit 283 MiB), the \
            unpickler's arena (about 380 bytes an item) being most of it; see SECURITY.md"]
fn dcp_metadata_of_a_million_byte_items_opens_within_2x_input_plus_64_mib() {
    if let Some(dir) = std::env::var_os(RSS_CHILD) {
        return open_byte_items(dir);
    }
    byte_items_within_bound("dcp_metadata_of_a_million_byte_items_opens_within_2x_input_plus_64_mib", 1_000_000);
}
