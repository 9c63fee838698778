//! End-to-end tests of the `tessera` binary: demo, inspect, verify, gc, unshard, convert, diff,
//! on local directories and on `s3://` locations (moto). (The benchmarks: tessera-bench's tests.)

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value as J;
use tessera_testkit::cli::{json, s3, text, Binary, Scratch};
use tessera_testkit::files::{copy_dir, snapshot};
use tessera_testkit::{azure, gcs};

/// The binary under test, run through the test kit's end-to-end harness.
const BIN: Binary = Binary::new(env!("CARGO_BIN_EXE_tessera"));

fn data_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    files
}

#[test]
fn demo_then_inspect_verify_corrupt_and_gc() {
    let scratch = Scratch::new("demo");
    let dir = scratch.path().to_str().unwrap();
    let out = BIN.expect(&["demo", "--size", "8MiB", "--dir", dir], 0);
    assert!(out.contains("every byte matched"), "{out}");
    assert!(out.contains("TP=2 × PP=2"), "{out}");
    // Rerunning into the same directory overwrites the checkpoint.
    BIN.expect(&["demo", "--size", "8MiB", "--dir", dir], 0);

    // The JSON summary.
    let s = json(&BIN.expect(&["inspect", dir, "--json"], 0));
    assert_eq!(s["format"]["backend"], "tessera");
    assert_eq!(s["format"]["version"], tessera::index::FORMAT_VERSION);
    let tensors = s["tensors"].as_object().unwrap();
    let emb = &tensors["embedding.word_embeddings.weight"];
    assert_eq!(emb["dtype"], "bf16");
    let shape: Vec<u64> = emb["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert_eq!(shape.len(), 2);
    assert_eq!(emb["chunks"], 4, "split 4 ways by TP, DP replicas not stored");
    assert_eq!(emb["bytes"].as_u64().unwrap(), shape[0] * shape[1] * 2);
    let qkv = &tensors["decoder.layers.self_attention.linear_qkv.weight"];
    assert_eq!(qkv["shape"][0], 8, "layers stacked on a prepended axis");
    assert_eq!(qkv["chunks"], 8 * 4);
    let opt = &tensors["optimizer.exp_avg.decoder.layers.self_attention.linear_qkv.weight"];
    assert_eq!(opt["dtype"], "f32");
    assert_eq!(opt["shape"], qkv["shape"]);
    assert_eq!(opt["chunks"], 8 * 4 * 2, "each TP box cut in two flat ranges across DP");
    for part in ["decoder.layers.mlp.fc1_w", "decoder.layers.mlp.fc1_v"] {
        assert_eq!(tensors[part]["dtype"], "bf16", "{part}");
    }
    assert_eq!(tensors["decoder.layers.input_layernorm.weight"]["chunks"], 8, "replicated norms stored once per layer");
    assert_eq!(s["objects"]["rng_state"]["shape"], serde_json::json!([4, 2]));
    assert_eq!(s["objects"]["rng_state"]["shards"], 8);
    assert_eq!(s["common"]["iteration"], 1000);
    assert_eq!(s["common"]["config"]["layers"], 8);
    assert_eq!(s["common"]["optimizer"]["param_groups"][0]["betas"][1], 0.95);
    assert!(s["common"]["data"]["tokenizer_digest"]["$bytes"].is_string());
    assert_eq!(s["content_metadata"]["producer"], "tessera demo");
    let total: u64 = tensors.values().map(|t| t["bytes"].as_u64().unwrap()).sum();
    assert_eq!(s["totals"]["tensor_bytes"].as_u64().unwrap(), total);

    // The text view and the full index dump.
    let t = BIN.expect(&["inspect", dir], 0);
    assert!(
        t.contains(&format!("tessera v{}", tessera::index::FORMAT_VERSION))
            && t.contains("rng_state")
            && t.contains("iteration = 1000"),
        "{t}"
    );
    let idx = json(&BIN.expect(&["inspect", dir, "--index-json"], 0));
    let chunks = idx["tensors"][0]["chunks"].as_array().unwrap();
    assert!(!chunks.is_empty());
    let crc = chunks[0]["crc32c"][0].as_str().unwrap();
    assert!(crc.len() == 8 && crc.chars().all(|c| c.is_ascii_hexdigit()), "{crc}");
    assert!(chunks[0]["file"].as_str().unwrap().ends_with(".safetensors"));
    let n_chunks: usize =
        idx["tensors"].as_array().unwrap().iter().map(|t| t["chunks"].as_array().unwrap().len()).sum();
    assert_eq!(n_chunks as u64, s["totals"]["chunks"].as_u64().unwrap());

    let v = BIN.expect(&["verify", dir], 0);
    assert!(v.contains("sound"), "{v}");

    // gc keeps everything committed and removes a leftover of an interrupted save.
    let g = BIN.expect(&["gc", dir], 0);
    assert!(g.contains("0 leftover"), "{g}");
    let leftover = scratch.path().join("0123456789abcdef-r00003.safetensors");
    std::fs::write(&leftover, b"partial").unwrap();
    let g = BIN.expect(&["gc", dir], 0);
    assert!(g.contains("removed 0123456789abcdef-r00003.safetensors"), "{g}");
    assert!(!leftover.exists());

    // Flip one byte near the end of the largest data file (tensor data): verify fails and names it.
    let victim = data_files(scratch.path()).into_iter().max_by_key(|p| std::fs::metadata(p).unwrap().len()).unwrap();
    let mut bytes = std::fs::read(&victim).unwrap();
    let at = bytes.len() - 1000;
    bytes[at] ^= 0x40;
    std::fs::write(&victim, &bytes).unwrap();
    let out = BIN.expect(&["verify", dir], 1);
    let name = victim.file_name().unwrap().to_str().unwrap();
    assert!(out.contains("CORRUPT") && out.contains(name), "{out}");

    // Without the index the directory is not a committed checkpoint.
    std::fs::remove_file(scratch.path().join("tessera.index")).unwrap();
    let out = BIN.run(&["verify", dir]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("no committed checkpoint in") && err.contains("found neither tessera.index"), "{err}");
    assert!(err.contains(&format!("`tessera gc {dir}` removes them")), "{err}");
    let out = BIN.run(&["inspect", dir, "--json"]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn demo_in_a_temporary_directory() {
    let out = BIN.expect(&["demo", "--size", "2MiB"], 0);
    assert!(out.contains("every byte matched") && out.contains("temporary"), "{out}");
    let dir = out.lines().find_map(|l| l.strip_prefix("checkpoint: ")).unwrap().split(" (").next().unwrap();
    assert!(!Path::new(dir).exists(), "{dir} was not removed");
}

#[test]
fn verify_of_a_missing_directory_fails_naming_it() {
    let scratch = Scratch::new("missing");
    let dir = scratch.path().join("nothing-here");
    let out = BIN.run(&["verify", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("nothing-here"), "{}", text(&out.stderr));
}

/// A folder of checkpoints (a run's step directories), an empty one, one of other files: each
/// is no checkpoint, and the message says what is there and what to do (the library's own
/// text, which Python callers get too).
#[test]
fn a_location_without_a_checkpoint_says_what_it_holds() {
    let scratch = Scratch::new("no-checkpoint");
    let run = scratch.path().join("run");
    for step in ["step100", "step200"] {
        BIN.expect(&["demo", "--size", "1MiB", "--dir", run.join(step).to_str().unwrap()], 0);
    }
    let run = run.to_str().unwrap();
    // (inspect lists such a folder: inspect_lists_a_folder_of_step_checkpoints.)
    for command in ["verify", "diff"] {
        let args: Vec<&str> = if command == "diff" { vec![command, run, run] } else { vec![command, run] };
        let out = BIN.run(&args);
        assert_ne!(out.status.code(), Some(0), "{command}");
        let err = text(&out.stderr);
        let said = format!("no checkpoint in {run}: it holds step100/, step200/ (checkpoints): pass one of them");
        assert!(err.contains(&said) && !err.contains("empty"), "{command}: {err}");
    }
    let empty = scratch.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = BIN.run(&["inspect", empty.to_str().unwrap()]);
    let said = format!("tessera: error: no checkpoint in {}: the directory is empty\n", empty.display());
    assert_eq!(text(&out.stderr), said);
    std::fs::write(empty.join("notes.txt"), b"x").unwrap();
    let out = BIN.run(&["inspect", empty.to_str().unwrap()]);
    assert!(text(&out.stderr).contains("; it holds notes.txt"), "{}", text(&out.stderr));
}

/// A training run's folder of step checkpoints: `inspect` lists them newest first, each with
/// its format and whether it is committed, and points out the latest committed one.
#[test]
fn inspect_lists_a_folder_of_step_checkpoints() {
    let scratch = Scratch::new("steps");
    let run = scratch.path().join("run");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tessera/tests/fixtures");
    copy_dir(&fixtures.join("golden_v2"), &run.join("step-100"));
    copy_dir(&fixtures.join("foreign/megatron_core019"), &run.join("iter_0000200"));
    // A native save that never committed: its data files, no index.
    copy_dir(&fixtures.join("golden_v1"), &run.join("step_300"));
    std::fs::remove_file(run.join("step_300/tessera.index")).unwrap();
    std::fs::create_dir_all(run.join("logs")).unwrap();
    std::fs::write(run.join("logs/train.txt"), b"x").unwrap();
    let dir = run.to_str().unwrap();

    let out = BIN.expect(&["inspect", dir], 0);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].contains("a folder of 3 step checkpoint(s), newest first"), "{out}");
    let row = |folder: &str| *lines.iter().find(|l| l.contains(folder)).unwrap_or_else(|| panic!("{folder}: {out}"));
    let at = |folder: &str| lines.iter().position(|l| l.contains(folder)).unwrap();
    assert!(at("step_300/") < at("iter_0000200/") && at("iter_0000200/") < at("step-100/"), "newest first: {out}");
    assert!(row("step_300/").contains("NOT committed") && row("step_300/").contains("tessera, data only"), "{out}");
    assert!(row("iter_0000200/").contains("torch_dist v1") && row("iter_0000200/").contains("latest committed"));
    assert!(row("step-100/").contains("tessera v2") && !row("step-100/").contains("latest"), "{out}");
    assert!(!out.contains("logs"), "{out}");
    assert!(out.contains("latest committed: iter_0000200 (step 200)"), "{out}");

    let j = json(&BIN.expect(&["inspect", dir, "--json"], 0));
    assert_eq!(j["latest_committed"], "iter_0000200");
    let steps = j["steps"].as_array().unwrap();
    let got: Vec<(u64, bool)> = steps.iter().map(|s| (s["step"].as_u64().unwrap(), s["committed"] == true)).collect();
    assert_eq!(got, [(300, false), (200, true), (100, true)]);
    assert_eq!((&steps[1]["format"], &steps[2]["format"]), (&J::from("torch_dist"), &J::from("tessera")));
    assert_eq!(steps[0]["data_files_of"], "tessera");
    assert!(steps[0]["problem"].as_str().unwrap().contains("no committed checkpoint"), "{j}");
}

#[test]
fn the_benchmarks_are_not_a_tessera_command() {
    // They are the tessera-bench binary's.
    assert_eq!(BIN.run(&["bench", "--plan-only"]).status.code(), Some(2));
}

#[test]
fn bad_sizes_are_refused() {
    let out = BIN.run(&["demo", "--size", "12parsecs"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("unknown unit"), "{}", text(&out.stderr));
}

#[test]
fn demo_inspect_verify_gc_on_s3() {
    let url = s3::url("demo");
    let out = BIN.s3().expect(&["demo", "--size", "4MiB", "--dir", &url], 0);
    assert!(out.contains("every byte matched") && out.contains(&format!("checkpoint: {url}")), "{out}");
    assert!(out.contains(&format!("next: tessera inspect {url}")), "{out}");

    let s = json(&BIN.s3().expect(&["inspect", &url, "--json"], 0));
    assert_eq!(s["path"], url.as_str());
    assert_eq!(s["format"]["backend"], "tessera");
    assert_eq!(s["tensors"]["embedding.word_embeddings.weight"]["chunks"], 4);
    assert_eq!(s["common"]["iteration"], 1000);
    assert_eq!(s["content_metadata"]["producer"], "tessera demo");
    let t = BIN.s3().expect(&["inspect", &url], 0);
    assert!(t.contains(&format!("checkpoint {url}")) && t.contains("rng_state"), "{t}");
    let v = BIN.s3().expect(&["verify", &url], 0);
    assert!(v.contains(&format!("{url}: sound")), "{v}");
    // A trailing slash names the same prefix.
    BIN.s3().expect(&["verify", &format!("{url}/")], 0);

    // gc keeps the committed checkpoint and removes the leftover of an interrupted save.
    let g = BIN.s3().expect(&["gc", &url], 0);
    assert!(g.contains("0 leftover"), "{g}");
    let leftover = s3::object_path(&url, "0123456789abcdef-r00003.safetensors");
    assert_eq!(s3::http(s3::endpoint(), "PUT", &leftover, b"partial"), 200);
    let g = BIN.s3().expect(&["gc", &url], 0);
    assert!(g.contains("removed 0123456789abcdef-r00003.safetensors") && g.contains("1 leftover"), "{g}");
    BIN.s3().expect(&["verify", &url], 0);

    // A damaged index (moto accepts unsigned PUTs of new objects only: a fresh prefix).
    let damaged = s3::url("damaged");
    assert_eq!(s3::http(s3::endpoint(), "PUT", &s3::object_path(&damaged, "tessera.index"), b"garbage"), 200);
    let out = BIN.s3().run(&["verify", &damaged]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains(&format!("{damaged}/tessera.index")), "{}", text(&out.stderr));
    assert_eq!(BIN.s3().run(&["inspect", &damaged]).status.code(), Some(1));

    // Leftovers of a save that never committed: not a committed checkpoint; gc removes them.
    let partial = s3::url("partial");
    assert_eq!(
        s3::http(s3::endpoint(), "PUT", &s3::object_path(&partial, "0123456789abcdef-r00000.safetensors"), b"x"),
        200
    );
    let out = BIN.s3().run(&["verify", &partial]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("no committed checkpoint in"), "{}", text(&out.stderr));
    let g = BIN.s3().expect(&["gc", &partial], 0);
    assert!(g.contains("removed 0123456789abcdef-r00000.safetensors"), "{g}");
    // An empty prefix: nothing there.
    let out = BIN.s3().run(&["verify", &s3::url("nothing-here")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("nothing-here"), "{}", text(&out.stderr));
}

/// Runs the binary with `args` and `env` only (no store variables inherited); expects `code`.
fn run_clean(args: &[String], env: &[(&str, &str)], code: i32) -> String {
    let out = clean_command(args, env).output().expect("run the binary under test");
    assert_eq!(out.status.code(), Some(code), "{args:?}: {}\n{}", text(&out.stdout), text(&out.stderr));
    text(&out.stdout)
}

/// The binary with `args`, the environment without any store's variables, plus `env`.
fn clean_command<S: AsRef<std::ffi::OsStr>>(args: &[S], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(BIN.path());
    cmd.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("AWS_") || k.starts_with("AZURE_") || k.starts_with("GOOGLE_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    cmd
}

/// demo, inspect, verify and unshard at `url`, every command given `extra` (storage options).
fn demo_round_trip(url: &str, extra: &[&str], env: &[(&str, &str)]) {
    fn with(args: &[&str], extra: &[&str]) -> Vec<String> {
        args.iter().chain(extra).map(|a| a.to_string()).collect()
    }
    let out = run_clean(&with(&["demo", "--size", "2MiB", "--dir", url], extra), env, 0);
    assert!(out.contains("every byte matched"), "{out}");
    let s = json(&run_clean(&with(&["inspect", url, "--json"], extra), env, 0));
    assert_eq!(s["format"]["backend"], "tessera");
    let v = run_clean(&with(&["verify", url], extra), env, 0);
    assert!(v.contains(&format!("{url}: sound")), "{v}");
    let scratch = Scratch::new("store-unshard");
    let one = scratch.path().join("model.safetensors");
    let out = run_clean(&with(&["unshard", url, "--out", one.to_str().unwrap()], extra), env, 0);
    assert!(out.contains("1 file(s)"), "{out}");
    let (_, tensors) = read_safetensors(&one);
    assert!(tensors.contains_key("embedding.word_embeddings.weight"), "{:?}", tensors.keys());
}

/// `az://` from the command line: Azurite reached through `--storage-option` alone, then
/// through a connection string in the environment (as the Azure CLI takes it).
#[test]
fn demo_inspect_verify_unshard_on_azure() {
    let endpoint = azure::endpoint();
    let options: Vec<String> =
        azure::config_for(endpoint).iter().map(|(k, v)| format!("--storage-option={k}={v}")).collect();
    let options: Vec<&str> = options.iter().map(String::as_str).collect();
    let url = format!("az://{}/cli-demo-{}", azure::CONTAINER, std::process::id());
    demo_round_trip(&url, &options, &[]);
    let conn = format!(
        "DefaultEndpointsProtocol=http;AccountName={};AccountKey={};BlobEndpoint={endpoint};",
        azure::ACCOUNT,
        azure::KEY
    );
    let url = format!("az://{}/cli-demo-conn-{}", azure::CONTAINER, std::process::id());
    demo_round_trip(&url, &[], &[("AZURE_STORAGE_CONNECTION_STRING", &conn)]);
}

/// `gs://` from the command line: fake-gcs-server (behind the harness's write adapter) named
/// by `GOOGLE_APPLICATION_CREDENTIALS`, a key file carrying `gcs_base_url` and
/// `disable_oauth` (plain HTTP allowed because the key names an `http://` base URL).
#[test]
fn demo_inspect_verify_unshard_on_gcs() {
    let scratch = Scratch::new("gcs-key");
    let key = scratch.path().join("emulator.json");
    let json = serde_json::json!({
        "gcs_base_url": gcs::endpoint(),
        "disable_oauth": true,
        "client_email": "",
        "private_key": "",
        "private_key_id": "",
    });
    std::fs::create_dir_all(scratch.path()).unwrap();
    std::fs::write(&key, json.to_string()).unwrap();
    let url = format!("gs://{}/cli-demo-{}", gcs::BUCKET, std::process::id());
    demo_round_trip(&url, &[], &[("GOOGLE_APPLICATION_CREDENTIALS", key.to_str().unwrap())]);
}

/// No credentials anywhere and no metadata service: one clear error, at once.
#[test]
fn missing_credentials_are_one_clear_error() {
    // Every store's metadata service pointed at a loopback port nobody serves (GCS's through
    // its client's variables, GCE_METADATA_HOST and GCE_METADATA_IP).
    let cases = [
        ("s3://b/x", "S3", vec!["--storage-option", "aws_metadata_endpoint=http://127.0.0.1:9"]),
        ("gs://b/x", "GCS", vec![]),
        ("az://c/x", "Azure", vec!["--storage-option", "azure_msi_endpoint=http://127.0.0.1:9"]),
    ];
    for (url, store, options) in cases {
        let started = std::time::Instant::now();
        let env = [
            ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent"),
            ("AWS_CONFIG_FILE", "/nonexistent"),
            ("AZURE_STORAGE_ACCOUNT_NAME", "acc"),
            ("GCE_METADATA_HOST", "127.0.0.1:9"),
            ("GCE_METADATA_IP", "127.0.0.1:9"),
            ("HOME", "/nonexistent"),
        ];
        let out = clean_command(&[&["inspect", url][..], &options[..]].concat(), &env).output().unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{url}: {err}");
        assert!(err.contains(&format!("no {store} credentials found: tried")), "{url}: {err}");
        assert!(err.contains("did not answer"), "{url}: {err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "{url}: {:?}", started.elapsed());
    }
}

// ---------------------------------------------------------------------------------------------
// unshard, convert, diff.

/// A parsed safetensors file: `__metadata__` and, per tensor, its dtype name, shape and bytes.
#[allow(clippy::type_complexity)]
fn read_safetensors(path: &Path) -> (J, std::collections::BTreeMap<String, (String, Vec<u64>, Vec<u8>)>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // The safetensors layout read on its own: an 8-byte little-endian header length, the JSON
    // header, then the data.
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let header: J = serde_json::from_slice(&bytes[8..8 + header_len as usize]).unwrap();
    let start = 8 + header_len;
    let mut tensors = std::collections::BTreeMap::new();
    for (name, e) in header.as_object().unwrap().iter().filter(|(n, _)| *n != "__metadata__") {
        let offs: Vec<usize> =
            e["data_offsets"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
        let shape = e["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        let data = bytes[start as usize + offs[0]..start as usize + offs[1]].to_vec();
        tensors.insert(name.clone(), (e["dtype"].as_str().unwrap().to_string(), shape, data));
    }
    (header["__metadata__"].clone(), tensors)
}

fn plain_tensors(dir: &Path) -> std::collections::BTreeMap<String, tessera::PlainTensor> {
    tessera::open(&tessera::storage::LocalStorage::new(dir)).and_then(|c| c.read_tensors(None)).unwrap()
}

#[test]
fn unshard_to_one_file_shards_a_key_subset_and_a_dtype() {
    let scratch = Scratch::new("unshard");
    let ck = scratch.path().join("ck");
    BIN.expect(&["demo", "--size", "1MiB", "--dir", ck.to_str().unwrap()], 0);
    let plain = plain_tensors(&ck);
    let ck = ck.to_str().unwrap();

    // One file: every tensor whole, as load_plain_tensors gives it.
    let one = scratch.path().join("out/model.safetensors");
    let out = BIN.expect(&["unshard", ck, "--out", one.to_str().unwrap(), "--memory", "1MiB"], 0);
    assert!(out.contains(&format!("{} tensors", plain.len())) && out.contains("1 file(s)"), "{out}");
    let (meta, tensors) = read_safetensors(&one);
    assert_eq!(meta, serde_json::json!({"format": "pt"}));
    assert_eq!(tensors.len(), plain.len());
    for (key, p) in &plain {
        let (dtype, shape, data) = &tensors[key];
        assert_eq!((dtype.as_str(), shape, data), (p.dtype.safetensors_name(), &p.shape, &p.data), "{key}");
    }

    // Shards of at most 256 KiB (or one tensor), with the index.
    let hf = scratch.path().join("hf");
    BIN.expect(&["unshard", ck, "--out", hf.to_str().unwrap(), "--max-shard-size", "256KiB"], 0);
    let index = json(&std::fs::read_to_string(hf.join("model.safetensors.index.json")).unwrap());
    let weight_map = index["weight_map"].as_object().unwrap();
    assert_eq!(weight_map.len(), plain.len());
    let files: std::collections::BTreeSet<&str> = weight_map.values().map(|v| v.as_str().unwrap()).collect();
    assert!(files.len() > 1, "{files:?}");
    let mut total = 0;
    for f in &files {
        assert!(f.starts_with("model-0000") && f.ends_with(&format!("-of-{:05}.safetensors", files.len())), "{f}");
        let (_, tensors) = read_safetensors(&hf.join(f));
        let bytes: u64 = tensors.values().map(|t| t.2.len() as u64).sum();
        assert!(bytes <= 256 << 10 || tensors.len() == 1, "{f}: {bytes} bytes in {} tensors", tensors.len());
        for (key, (_, _, data)) in &tensors {
            assert_eq!(weight_map[key], *f);
            assert_eq!(data, &plain[key].data, "{key}");
            total += data.len() as u64;
        }
    }
    assert_eq!(index["metadata"]["total_size"], total);
    // Decimal units are accepted too; a size that holds everything gives one shard.
    let big = scratch.path().join("big");
    BIN.expect(&["unshard", ck, "--out", big.to_str().unwrap(), "--max-shard-size", "5GB"], 0);
    assert!(big.join("model-00001-of-00001.safetensors").exists());

    // A key subset, cast to bf16.
    let sub = scratch.path().join("sub.safetensors");
    let args = ["unshard", ck, "--out", sub.to_str().unwrap(), "--keys", r"^optimizer\.exp_avg\.", "--dtype", "bf16"];
    BIN.expect(&args, 0);
    let (_, tensors) = read_safetensors(&sub);
    let wanted: Vec<&String> = plain.keys().filter(|k| k.starts_with("optimizer.exp_avg.")).collect();
    assert!(!wanted.is_empty());
    assert_eq!(tensors.keys().collect::<Vec<_>>(), wanted);
    for (key, (dtype, _, data)) in &tensors {
        let p = &plain[key];
        assert_eq!(p.dtype, tessera::DType::F32, "{key}");
        assert_eq!(dtype, "BF16", "{key}");
        assert_eq!(data, &p.dtype.cast_bytes(&p.data, tessera::DType::BF16).unwrap(), "{key}");
    }

    // An empty selection, an unknown dtype, a bad size: errors.
    let out = BIN.run(&["unshard", ck, "--out", sub.to_str().unwrap(), "--keys", "^nothing"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("matches no key"), "{}", text(&out.stderr));
    assert_eq!(BIN.run(&["unshard", ck, "--out", "x.safetensors", "--dtype", "i32"]).status.code(), Some(2));
    let out = BIN.run(&["unshard", ck, "--out", "x.safetensors", "--memory", "lots"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!Path::new("x.safetensors").exists());
}

#[test]
fn convert_round_trip_then_verify_and_diff() {
    let scratch = Scratch::new("convert");
    let ck = scratch.path().join("ck");
    let conv = scratch.path().join("conv");
    let (ck, conv) = (ck.to_str().unwrap(), conv.to_str().unwrap());
    BIN.expect(&["demo", "--size", "1MiB", "--dir", ck], 0);
    let out = BIN.expect(&["convert", ck, conv, "--memory", "1MiB"], 0);
    assert!(out.contains("tensors in") && out.contains("object shard(s)"), "{out}");
    let v = BIN.expect(&["verify", conv], 0);
    assert!(v.contains("sound"), "{v}");
    let d = BIN.expect(&["diff", ck, conv], 0);
    assert!(d.contains("equal"), "{d}");
    assert_eq!(plain_tensors(Path::new(conv)), plain_tensors(Path::new(ck)));
    // A committed destination is refused, unless --overwrite (the flag, as the message says).
    let out = BIN.run(&["convert", ck, conv]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("already exists") && err.contains("pass --overwrite to replace it"), "{err}");
    BIN.expect(&["convert", ck, conv, "--overwrite"], 0);
    BIN.expect(&["verify", conv], 0);
    // A source that is not a checkpoint.
    let out = BIN.run(&["convert", scratch.path().join("nothing").to_str().unwrap(), conv, "--overwrite"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("/nothing: no such directory"), "{}", text(&out.stderr));
}

#[test]
fn convert_to_dcp_and_back() {
    let scratch = Scratch::new("convert-dcp");
    let (ck, dcp, back) = (scratch.path().join("ck"), scratch.path().join("dcp"), scratch.path().join("back"));
    let (ck, dcp, back) = (ck.to_str().unwrap(), dcp.to_str().unwrap(), back.to_str().unwrap());
    BIN.expect(&["demo", "--size", "1MiB", "--dir", ck], 0);
    let out = BIN.expect(&["convert", ck, dcp, "--to", "dcp", "--memory", "1MiB"], 0);
    assert!(out.contains("tensors in"), "{out}");
    for name in [".metadata", "metadata.json", "common.pt"] {
        assert!(Path::new(dcp).join(name).exists(), "{name}");
    }
    let data = std::fs::read_dir(dcp).unwrap().filter_map(|e| e.ok()).filter(|e| {
        let n = e.file_name().to_string_lossy().into_owned();
        n.starts_with("__0_") && n.ends_with(".distcp")
    });
    assert_eq!(data.count(), 1, "rank 0's data file");
    assert_eq!(plain_tensors(Path::new(dcp)), plain_tensors(Path::new(ck)));
    // The copy holds what its source holds: objects and common state too.
    let d = BIN.expect(&["diff", ck, dcp], 0);
    assert!(d.contains("equal"), "{d}");
    // And back to the native format (the default target).
    BIN.expect(&["convert", dcp, back], 0);
    assert_eq!(plain_tensors(Path::new(back)), plain_tensors(Path::new(ck)));
    // A committed destination is refused, unless --overwrite; an unknown target is a usage error.
    let out = BIN.run(&["convert", ck, dcp, "--to", "dcp"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("already exists"), "{}", text(&out.stderr));
    BIN.expect(&["convert", ck, dcp, "--to", "torch_dist", "--overwrite"], 0);
    assert_eq!(plain_tensors(Path::new(dcp)), plain_tensors(Path::new(ck)));
    assert_eq!(BIN.run(&["convert", ck, dcp, "--to", "zarr"]).status.code(), Some(2));
}

/// A one-rank checkpoint with tensors `x` (and `y`) and a common value.
fn small_checkpoint(dir: &Path, x: &[f32], with_y: bool, iteration: i64) {
    use tessera::{DType, ShardedTensor, StateTree, TensorData, Value};
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut tree = StateTree::map()
        .with("x", StateTree::Tensor(ShardedTensor::full("x", DType::F32, &[x.len() as u64], TensorData::Owned(bytes))))
        .with("iteration", StateTree::Value(Value::Int(iteration)));
    if with_y {
        tree.insert("y", StateTree::Tensor(ShardedTensor::full("y", DType::U8, &[2], TensorData::Owned(vec![1, 2]))));
    }
    tessera::save(tree, &tessera::storage::LocalStorage::new(dir), &tessera::comm::SoloComm, &Default::default())
        .unwrap();
}

#[test]
fn diff_exit_codes_name_the_differing_keys() {
    let scratch = Scratch::new("diff");
    let (a, b) = (scratch.path().join("a"), scratch.path().join("b"));
    small_checkpoint(&a, &[1.0, 2.0, 3.0, 4.0], false, 1);
    small_checkpoint(&b, &[1.0, 2.0, 3.5, 4.0], true, 2);
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    BIN.expect(&["diff", a, a], 0);
    let out = BIN.expect(&["diff", a, b], 1);
    assert!(out.contains("tensor x: 1 element(s) differ, max |a - b| = 0.5, first at [2]"), "{out}");
    assert!(out.contains("tensor y: only in B"), "{out}");
    assert!(out.contains("common iteration: 1 vs 2"), "{out}");
    assert!(out.contains("DIFFERENT: 3 difference(s)"), "{out}");
    // Within the tolerance, on the selected keys only: equal.
    let out = BIN.expect(&["diff", a, b, "--atol", "0.5", "--keys", "^x$"], 0);
    assert!(out.contains("equal"), "{out}");
    let out = BIN.expect(&["diff", a, b, "--atol", "0.25", "--keys", "^x$"], 1);
    assert!(out.contains("tensor x:") && !out.contains("tensor y") && !out.contains("common"), "{out}");
    // Errors exit 2: a missing checkpoint, a selection matching nothing, a bad regex, bad usage.
    let missing = scratch.path().join("missing");
    let out = BIN.run(&["diff", a, missing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("missing"), "{}", text(&out.stderr));
    assert_eq!(BIN.run(&["diff", a, b, "--keys", "^nothing$"]).status.code(), Some(2));
    assert_eq!(BIN.run(&["diff", a, b, "--keys", "("]).status.code(), Some(2));
    assert_eq!(BIN.run(&["diff", a, b, "--atol", "-1"]).status.code(), Some(2));
    assert_eq!(BIN.run(&["diff", a]).status.code(), Some(2));
}

#[test]
fn unshard_convert_diff_with_s3_locations() {
    let scratch = Scratch::new("tools-s3");
    let ck = scratch.path().join("ck");
    let ck = ck.to_str().unwrap();
    BIN.expect(&["demo", "--size", "1MiB", "--dir", ck], 0);
    let url = s3::url("converted");
    BIN.s3().expect(&["convert", ck, &url], 0);
    BIN.s3().expect(&["verify", &url], 0);
    let d = BIN.s3().expect(&["diff", ck, &url], 0);
    assert!(d.contains("equal"), "{d}");
    let (local, remote) = (scratch.path().join("local.safetensors"), scratch.path().join("remote.safetensors"));
    BIN.expect(&["unshard", ck, "--out", local.to_str().unwrap()], 0);
    BIN.s3().expect(&["unshard", &url, "--out", remote.to_str().unwrap()], 0);
    assert_eq!(std::fs::read(&local).unwrap(), std::fs::read(&remote).unwrap());
    let out = BIN.s3().run(&["convert", ck, &url]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("already exists"), "{}", text(&out.stderr));
}

// ---------------------------------------------------------------------------------------------
// Foreign checkpoints (fixtures of the library's tests).

/// A fixture checkpoint of the library's tests (`set`: `foreign`, `olmo`).
fn fixture(set: &str, name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tessera/tests/fixtures")
        .join(set)
        .join(name)
        .to_string_lossy()
        .into_owned()
}

fn foreign(name: &str) -> String {
    fixture("foreign", name)
}

#[test]
fn inspect_verify_unshard_convert_and_diff_a_megatron_checkpoint() {
    let src = foreign("megatron_tp2_dp2");
    let shown = BIN.expect(&["inspect", &src], 0);
    assert!(shown.contains("torch_dist v1"), "{shown}");
    assert!(shown.contains("layers.qkv.weight") && shown.contains("rng_state"), "{shown}");
    assert!(shown.contains("iteration = 1234"), "{shown}");
    let j = json(&BIN.expect(&["inspect", &src, "--json"], 0));
    assert_eq!(j["format"]["backend"], "torch_dist", "{j}");
    BIN.expect(&["verify", &src], 0);

    let scratch = Scratch::new("foreign-tools");
    let out = scratch.path().join("model.safetensors");
    BIN.expect(&["unshard", &src, "--out", out.to_str().unwrap(), "--keys", "^layers\\."], 0);
    let (_, tensors) = read_safetensors(&out);
    assert_eq!(tensors.keys().collect::<Vec<_>>(), ["layers.norm.weight", "layers.proj.weight", "layers.qkv.weight"]);
    let plain = tessera::open(&tessera::storage::LocalStorage::new(&src)).and_then(|c| c.read_tensors(None)).unwrap();
    for (k, (_, shape, data)) in &tensors {
        assert_eq!((shape, data), (&plain[k].shape, &plain[k].data), "{k}");
    }

    let native = scratch.path().join("native");
    BIN.expect(&["convert", &src, native.to_str().unwrap()], 0);
    BIN.expect(&["verify", native.to_str().unwrap()], 0);
    let same = BIN.expect(&["diff", &src, native.to_str().unwrap()], 0);
    assert!(same.contains("equal"), "{same}");
    // Against a different checkpoint: exit 1, naming keys.
    let other = foreign("dcp_mesh2d");
    let differ = BIN.expect(&["diff", &src, &other], 1);
    assert!(differ.contains("embedding.weight"), "{differ}");
    // gc cleans torch_dist locations too: a committed one, without leftovers, keeps every file.
    let g = BIN.expect(&["gc", &src], 0);
    assert!(g.contains("0 leftover file(s) removed"), "{g}");
}

fn olmo(name: &str) -> String {
    fixture("olmo", name)
}

#[test]
fn every_tool_works_on_an_olmo_core_checkpoint() {
    // Written by ai2-olmo-core 0.1.0 (FSDP1, 3 ranks): model/ and optim/ as one checkpoint.
    let src = olmo("olmo_fsdp1_w3");
    let shown = BIN.expect(&["inspect", &src], 0);
    assert!(shown.contains("olmo_safetensors v1") && shown.contains("no checksums"), "{shown}");
    assert!(shown.contains("model/embed.weight") && shown.contains("optim/state.embed.weight.__exp_avg"), "{shown}");
    assert!(shown.contains("optim.param_groups") && shown.contains("\"lr\":0.01"), "{shown}");
    let j = json(&BIN.expect(&["inspect", &src, "--json"], 0));
    assert_eq!(j["format"]["backend"], "olmo_safetensors", "{j}");
    let verified = BIN.expect(&["verify", &src], 0);
    assert!(verified.contains("sound") && verified.contains("no block checksums"), "{verified}");

    // unshard the whole, model/ alone and optim/ alone: OLMo-core's own unshard, key for key.
    let scratch = Scratch::new("olmo-tools");
    let expected = read_safetensors(Path::new(&olmo("olmo_fsdp1_w3.expected.safetensors"))).1;
    for (dir, prefix) in [("", ""), ("/model", "model/"), ("/optim", "optim/")] {
        let out = scratch.path().join(format!("u{}.safetensors", prefix.len()));
        BIN.expect(&["unshard", &format!("{src}{dir}"), "--out", out.to_str().unwrap()], 0);
        let (_, tensors) = read_safetensors(&out);
        let want: Vec<(String, _)> =
            expected.iter().filter_map(|(k, v)| k.strip_prefix(prefix).map(|k| (k.to_string(), v))).collect();
        assert_eq!(tensors.len(), want.len(), "{dir}");
        for (k, v) in want {
            assert_eq!(&tensors[&k], v, "{dir}: {k}");
        }
    }

    // convert to native; diff against the conversion is equal; the native copy is checksummed.
    let native = scratch.path().join("native");
    BIN.expect(&["convert", &src, native.to_str().unwrap()], 0);
    BIN.expect(&["verify", native.to_str().unwrap()], 0);
    let same = BIN.expect(&["diff", &src, native.to_str().unwrap()], 0);
    assert!(same.contains("equal"), "{same}");
    let differ = BIN.expect(&["diff", &src, &olmo("olmo_fsdp1_w2")], 1);
    assert!(differ.contains("model/embed.weight"), "{differ}");
    // gc cleans OLMo-core locations too: a committed one, without leftovers, keeps every file.
    let g = BIN.expect(&["gc", &src], 0);
    assert!(g.contains("0 leftover file(s) removed"), "{g}");
}

// ---------------------------------------------------------------------------------------------
// Outputs that must not destroy user files.

/// Runs, expects exit code 1 and a message naming `path`; returns stderr.
#[test]
fn unshard_refuses_outputs_inside_the_source_and_onto_special_files() {
    let scratch = Scratch::new("unshard-hostile");
    let ck = scratch.path().join("ck");
    BIN.expect(&["demo", "--size", "1MiB", "--dir", ck.to_str().unwrap()], 0);
    let before = snapshot(&ck);
    let src = ck.to_str().unwrap();
    for out in [ck.join("tessera.index"), ck.join("model.safetensors")] {
        let err = BIN.refused(&["unshard", src, "--out", out.to_str().unwrap()], &out);
        assert!(err.contains("inside the source checkpoint"), "{err}");
    }
    let err = BIN.refused(&["unshard", src, "--out", src, "--max-shard-size", "1MiB"], &ck);
    assert!(err.contains("inside the source checkpoint"), "{err}");
    assert_eq!(snapshot(&ck), before, "the source is intact, byte for byte");
    BIN.expect(&["verify", src], 0);

    // A FIFO, a symlink to a user file, a directory: refused, left as they are.
    let outs = scratch.path().join("outs");
    std::fs::create_dir_all(&outs).unwrap();
    let fifo = outs.join("fifo.safetensors");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let victim = scratch.path().join("victim.txt");
    std::fs::write(&victim, b"user data").unwrap();
    let link = outs.join("link.safetensors");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let dir = outs.join("dir.safetensors");
    std::fs::create_dir(&dir).unwrap();
    let before = snapshot(&outs);
    for out in [&fifo, &link] {
        BIN.refused(&["unshard", src, "--out", out.to_str().unwrap()], out);
    }
    // A directory's model.safetensors, the same way.
    let inside = dir.join("model.safetensors");
    std::os::unix::fs::symlink(&victim, &inside).unwrap();
    BIN.refused(&["unshard", src, "--out", dir.to_str().unwrap()], &inside);
    std::fs::remove_file(&inside).unwrap();
    assert_eq!(snapshot(&outs), before);
    assert_eq!(std::fs::read(&victim).unwrap(), b"user data");

    // A device node: refused without modifying it (tests may run as root).
    use std::os::unix::fs::MetadataExt;
    let null = Path::new("/dev/null");
    let m0 = std::fs::symlink_metadata(null).unwrap();
    let err = BIN.refused(&["unshard", src, "--out", "/dev/null"], null);
    assert!(err.contains("not a regular file"), "{err}");
    let m1 = std::fs::symlink_metadata(null).unwrap();
    assert_eq!((m0.ino(), m0.mode(), m0.rdev()), (m1.ino(), m1.mode(), m1.rdev()));

    // A regular file is replaced, as before.
    let regular = outs.join("model.safetensors");
    std::fs::write(&regular, b"old").unwrap();
    BIN.expect(&["unshard", src, "--out", regular.to_str().unwrap()], 0);
    assert!(std::fs::metadata(&regular).unwrap().len() > 1000);
}

/// `--out` naming a directory (an existing one, or a path ending with `/`) without
/// `--max-shard-size`: the one file goes into it as `model.safetensors`, never a file named
/// like the directory.
#[test]
fn unshard_into_a_directory_writes_model_safetensors_there() {
    let scratch = Scratch::new("unshard-dir");
    let ck = scratch.path().join("ck");
    BIN.expect(&["demo", "--size", "1MiB", "--dir", ck.to_str().unwrap()], 0);
    let src = ck.to_str().unwrap();
    let hf = scratch.path().join("hf");
    let out = BIN.expect(&["unshard", src, "--out", &format!("{}/", hf.display())], 0);
    assert!(hf.is_dir(), "hf/ is a directory");
    let file = hf.join("model.safetensors");
    assert!(out.contains(&file.display().to_string()), "{out}");
    let (_, tensors) = read_safetensors(&file);
    assert_eq!(tensors.len(), plain_tensors(&ck).len());
    // An existing directory, named without the slash: the same.
    std::fs::remove_file(&file).unwrap();
    BIN.expect(&["unshard", src, "--out", hf.to_str().unwrap()], 0);
    assert!(file.is_file());
    // A file named with a trailing slash: refused, the file kept.
    let plain = scratch.path().join("plain.safetensors");
    std::fs::write(&plain, b"mine").unwrap();
    let err = BIN.refused(&["unshard", src, "--out", &format!("{}/", plain.display())], &plain);
    assert!(err.contains("is a file"), "{err}");
    assert_eq!(std::fs::read(&plain).unwrap(), b"mine");
    // --help says so.
    let help = BIN.expect(&["unshard", "--help"], 0);
    assert!(help.contains("model.safetensors"), "{help}");
}

#[test]
fn convert_into_a_directory_holding_a_dcp_checkpoint_needs_overwrite() {
    let scratch = Scratch::new("convert-hostile");
    let ck = scratch.path().join("ck");
    BIN.expect(&["demo", "--size", "1MiB", "--dir", ck.to_str().unwrap()], 0);
    let dst = scratch.path().join("dcp");
    copy_dir(Path::new(&foreign("dcp_single")), &dst);
    let before = snapshot(&dst);
    let err = BIN.refused(&["convert", ck.to_str().unwrap(), dst.to_str().unwrap()], &dst);
    assert!(err.contains("already exists"), "{err}");
    assert_eq!(snapshot(&dst), before, "the DCP checkpoint is not shadowed");
    BIN.expect(&["convert", ck.to_str().unwrap(), dst.to_str().unwrap(), "--overwrite"], 0);
    BIN.expect(&["verify", dst.to_str().unwrap()], 0);
    let s = json(&BIN.expect(&["inspect", dst.to_str().unwrap(), "--json"], 0));
    assert_eq!(s["format"]["backend"], "tessera");
}

#[test]
fn the_demo_overwrites_only_a_checkpoint_a_demo_wrote() {
    // (The benchmarks' side of this: tessera-bench's tests.)
    let scratch = Scratch::new("demo-hostile");
    let d = scratch.path();
    let theirs = d.join("theirs");
    copy_dir(Path::new(&foreign("dcp_single")), &theirs);
    let before = snapshot(&theirs);
    let err = BIN.refused(&["demo", "--size", "1MiB", "--dir", theirs.to_str().unwrap()], &theirs);
    assert!(err.contains("overwrite"), "{err}");
    assert_eq!(snapshot(&theirs), before);
    let native = d.join("native");
    BIN.expect(&["demo", "--size", "1MiB", "--dir", native.to_str().unwrap()], 0);
    let converted = d.join("converted");
    BIN.expect(&["convert", &foreign("dcp_single"), converted.to_str().unwrap()], 0);
    let before = snapshot(&converted);
    BIN.refused(&["demo", "--size", "1MiB", "--dir", converted.to_str().unwrap()], &converted);
    assert_eq!(snapshot(&converted), before);
    BIN.expect(&["demo", "--size", "1MiB", "--dir", native.to_str().unwrap()], 0);
}

#[test]
fn verify_and_unshard_refuse_a_chunk_linked_out_of_the_checkpoint() {
    // A zarr chunk linked to the process's environment: nothing of it may reach the output, and
    // both commands fail naming the chunk.
    let scratch = Scratch::new("hostile-link");
    let ck = scratch.path().join("ck");
    copy_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tessera/tests/fixtures/foreign/megatron_zarr"), &ck);
    std::fs::remove_file(ck.join("step_counts/0.1")).unwrap();
    std::os::unix::fs::symlink("/proc/self/environ", ck.join("step_counts/0.1")).unwrap();
    let out = BIN.run(&["verify", ck.to_str().unwrap()]);
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("step_counts/0.1") && said.contains("symbolic link"), "{said}");
    let dest = scratch.path().join("model.safetensors");
    let out = BIN.run(&["unshard", ck.to_str().unwrap(), "--out", dest.to_str().unwrap()]);
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("step_counts/0.1") && said.contains("symbolic link"), "{said}");
    assert!(!dest.exists());
}
