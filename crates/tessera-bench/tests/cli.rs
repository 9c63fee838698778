//! End-to-end tests of the `tessera-bench` binary: save and resharded load against raw IO,
//! async save, fully-parallel save, planning, and an object store against a local directory
//! (`s3://` locations on moto).

use tessera::Storage;
use tessera_testkit::cli::{json, s3, text, Binary, Scratch};

/// The binary under test, run through the test kit's end-to-end harness (the one the `tessera`
/// command's tests use).
const BIN: Binary = Binary::new(env!("CARGO_BIN_EXE_tessera-bench"));

/// `tessera::tools::verify` of the checkpoint in `storage`: its problems (none: sound), or why it
/// could not be opened.
fn verify(storage: &dyn Storage) -> Result<Vec<String>, String> {
    tessera::tools::verify(storage, 2).map(|r| r.problems).map_err(|e| e.to_string())
}

/// [`verify`] of a local directory.
fn verify_dir(dir: &std::path::Path) -> Result<Vec<String>, String> {
    verify(&tessera::storage::LocalStorage::new(dir))
}

/// An `s3://` location on the test server, opened with the library.
fn object_storage(url: &str) -> tessera::storage::ObjectStorage {
    tessera::storage::ObjectStorage::open(url, tessera_testkit::s3::test_options()).unwrap()
}

#[test]
fn bench_json_has_the_required_fields() {
    let scratch = Scratch::new("bench");
    let dir = scratch.path().to_str().unwrap();
    let b = json(&BIN.expect(&["--dir", dir, "--size", "8MiB", "--ranks", "2", "--rounds", "2", "--json"], 0));
    for field in ["save_vs_raw", "load_vs_raw", "bytes_read_vs_needed", "peak_rss_bytes", "save_secs", "load_secs"] {
        assert!(b[field].as_f64().is_some_and(|x| x > 0.0), "{field}: {b}");
    }
    assert_eq!(b["rounds"], 2);
    // Every round's ratios, and the summary is their median (the mean of the two).
    for (field, rounds) in [("save_vs_raw", "save_vs_raw_rounds"), ("load_vs_raw", "load_vs_raw_rounds")] {
        let per_round: Vec<f64> = b[rounds].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        assert_eq!(per_round.len(), 2, "{rounds}: {b}");
        assert!(per_round.iter().all(|&x| x > 0.0), "{rounds}: {b}");
        let median = b[field].as_f64().unwrap();
        assert!((median - (per_round[0] + per_round[1]) / 2.0).abs() <= 1e-9 * median, "{field}: {b}");
    }
    for field in ["save_peak_rss_bytes", "save_extra_bytes", "load_peak_rss_bytes", "load_extra_bytes"] {
        assert!(b[field].as_u64().is_some_and(|x| x > 0), "{field}: {b}");
    }
    assert!(b["peak_rss_bytes"].as_u64() >= b["load_peak_rss_bytes"].as_u64());
    assert!(b["bytes_read_vs_needed"].as_f64().unwrap() >= 1.0);
    assert_eq!(b["bytes_needed"].as_u64(), b["load_target_bytes"].as_u64());
    assert_eq!(b["verified"], true);
    assert_eq!(b["failed_rounds"], serde_json::json!([]));
    assert_eq!(b["load_ranks"], 1);
    // The raw file and the checkpoint are cleaned up.
    assert_eq!(std::fs::read_dir(scratch.path()).unwrap().count(), 0);
}

#[test]
fn bench_text_reports_every_round_and_keeps_the_last_checkpoint() {
    let scratch = Scratch::new("bench-text");
    let dir = scratch.path().to_str().unwrap();
    let out = BIN.expect(&["--dir", dir, "--size", "4MiB", "--ranks", "2", "--rounds", "2", "--keep"], 0);
    for round in ["round 1/2", "round 2/2"] {
        assert_eq!(out.lines().filter(|l| l.starts_with(round)).count(), 1, "{round}:\n{out}");
    }
    assert!(out.lines().any(|l| l.starts_with("median") && l.contains("min–max")), "{out}");
    assert!(out.contains("every loaded byte matched in every round"), "{out}");
    // --keep leaves the last round's checkpoint, sound, and nothing else.
    let names: Vec<_> = std::fs::read_dir(scratch.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["ckpt"]);
    assert_eq!(verify_dir(&scratch.path().join("ckpt")), Ok(vec![]));
    let out = BIN.run(&["--dir", dir, "--size", "4MiB", "--rounds", "0"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("--rounds"), "{}", text(&out.stderr));
}

#[test]
fn bench_async_json_has_the_required_fields() {
    let scratch = Scratch::new("bench-async");
    let dir = scratch.path().to_str().unwrap();
    let args = ["--async", "--dir", dir, "--size", "8MiB", "--ranks", "2", "--budget", "1MiB", "--rounds", "2"];
    let b = json(&BIN.expect(&[&args[..], &["--json"]].concat(), 0));
    assert_eq!((b["mode"].as_str(), b["ranks"].as_u64(), b["rounds"].as_u64()), (Some("async"), Some(2), Some(2)));
    assert!(b["share_bytes_max"].as_u64().is_some_and(|x| x > 1 << 20), "{b}");
    // A 1 MiB budget stages each rank's ~4 MiB in waves; the second configuration holds it all.
    let configs = b["configs"].as_array().unwrap();
    let names: Vec<_> = configs.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["waves", "whole_share"]);
    assert_eq!((configs[0]["holds_share"].as_bool(), configs[1]["holds_share"].as_bool()), (Some(false), Some(true)));
    assert_eq!(configs[0]["pool_bytes_per_rank"], 1 << 20);
    for c in configs {
        for field in [
            "memcpy_secs",
            "plan_secs",
            "blocking_secs",
            "total_secs",
            "sync_secs",
            "blocking_vs_memcpy",
            "blocking_vs_sync",
            "total_vs_sync",
            "pool_create_secs",
            "peak_rss_extra_vs_budget",
        ] {
            assert!(c[field].as_f64().is_some_and(|x| x > 0.0), "{field}: {c}");
        }
        // Every round's ratios, and the summary is their median (the mean of the two).
        for field in ["blocking_vs_memcpy", "blocking_vs_sync", "total_vs_sync"] {
            let rounds: Vec<f64> =
                c[format!("{field}_rounds")].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            assert_eq!(rounds.len(), 2, "{field}: {c}");
            let median = c[field].as_f64().unwrap();
            assert!((median - (rounds[0] + rounds[1]) / 2.0).abs() <= 1e-9 * median, "{field}: {c}");
        }
        let pool = c["pool_bytes_per_rank"].as_u64().unwrap();
        assert_eq!(c["pool_bytes_total"].as_u64(), Some(2 * pool));
        let peaks = c["pool_peak_in_use_bytes_per_rank"].as_array().unwrap();
        assert_eq!(peaks.len(), 2, "{c}");
        assert!(peaks.iter().all(|p| p.as_u64().is_some_and(|p| p > 0 && p <= pool)), "{c}");
        assert!(c["peak_rss_bytes"].as_u64() > c["rss_before_pools_bytes"].as_u64(), "{c}");
        assert!(c["pool_rss_bytes"].as_u64().is_some_and(|x| x > 0), "{c}");
        assert_eq!(c["chunks"], c["sync_chunks"]);
        assert_eq!(c["verified"], true);
    }
    assert_eq!(b["verified"], true);
    // The checkpoint is cleaned up.
    assert_eq!(std::fs::read_dir(scratch.path()).unwrap().count(), 0);
    // Text: every round of both configurations, their medians and memory.
    let out = BIN.expect(&args, 0);
    assert_eq!(out.lines().filter(|l| l.starts_with("round 2/2")).count(), 2, "{out}");
    assert_eq!(out.lines().filter(|l| l.starts_with("median") && l.contains("min–max")).count(), 2, "{out}");
    assert!(out.contains("over the RSS before the pools"), "{out}");
    // --budget belongs to --async.
    assert_eq!(BIN.run(&["--dir", dir, "--budget", "1MiB"]).status.code(), Some(2));
}

#[test]
fn bench_fully_parallel_json_reports_bytes_per_rank() {
    let scratch = Scratch::new("bench-parallel");
    let dir = scratch.path().to_str().unwrap();
    let args = ["--fully-parallel", "--dir", dir, "--size", "4MiB", "--dp", "2,4", "--rounds", "1", "--json"];
    let b = json(&BIN.expect(&args, 0));
    assert_eq!((b["mode"].as_str(), b["tp"].as_u64()), (Some("fully_parallel"), Some(1)));
    let runs = b["runs"].as_array().unwrap();
    assert_eq!(runs.iter().map(|r| r["dp"].as_u64().unwrap()).collect::<Vec<_>>(), [2, 4]);
    for r in runs {
        let dp = r["dp"].as_u64().unwrap() as usize;
        let ideal = r["ideal_bytes_per_rank"].as_f64().unwrap();
        assert!(ideal > 0.0, "{r}");
        for mode in ["distribute", "main_only"] {
            let per_rank = r[mode]["bytes_written_per_rank"].as_array().unwrap();
            assert_eq!(per_rank.len(), dp, "{mode}: {r}");
        }
        // Only the main replicas write without distribution: one rank writes everything.
        assert!(r["main_only"]["max_vs_ideal"].as_f64().unwrap() >= dp as f64 * 0.99, "{r}");
        assert!(r["distribute"]["max_bytes"].as_u64() < r["main_only"]["max_bytes"].as_u64(), "{r}");
        assert_eq!(r["time_distribute_vs_main_only_rounds"].as_array().unwrap().len(), 1, "{r}");
        assert!(r["time_distribute_vs_main_only"].as_f64().is_some_and(|x| x > 0.0), "{r}");
        assert_eq!(r["chunks"], r["main_only_chunks"]);
        assert_eq!(r["verified"], true);
    }
    assert_eq!(std::fs::read_dir(scratch.path()).unwrap().count(), 0);
}

#[test]
fn bench_plan_only_simulates_many_ranks() {
    let b = json(&BIN.expect(&["--plan-only", "--ranks", "64", "--tensors", "20", "--json"], 0));
    assert_eq!(b["ranks"], 64);
    assert_eq!(b["shards"], 64 * 20);
    // 10 parameters stored once per TP rank, 10 optimizer tensors stored once per rank.
    assert_eq!(b["chunks"], 10 * 8 + 10 * 64);
    for field in ["index_bytes_per_chunk", "gathered_bytes_total", "bytes_sent_per_rank", "load_plan_bytes_needed"] {
        assert!(b[field].as_f64().is_some_and(|x| x > 0.0), "{field}: {b}");
    }
    let text = BIN.expect(&["--plan-only", "--ranks", "8", "--tensors", "4"], 0);
    assert!(text.contains("validate") && text.contains("bytes/chunk"), "{text}");
}

#[test]
fn benchmarks_delete_only_what_they_created() {
    let scratch = Scratch::new("bench-hostile");
    let d = scratch.path();
    let ckpt = d.join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let user = ckpt.join("user.txt");
    std::fs::write(&user, b"user data").unwrap();
    let dir = d.to_str().unwrap();
    let small = ["--size", "2MiB", "--ranks", "2", "--rounds", "1"];
    for mode in [&["--async", "--budget", "1MiB"][..], &["--fully-parallel", "--dp", "2"][..], &[][..]] {
        let args =
            [&["--dir", dir][..], mode, if mode.contains(&"--fully-parallel") { &small[..2] } else { &small }].concat();
        let err = BIN.refused(&args, &ckpt);
        assert!(err.contains("not empty"), "{err}");
        assert_eq!(std::fs::read(&user).unwrap(), b"user data", "{mode:?}");
    }
    // The default benchmark's raw file: a user file of that name is neither truncated nor removed.
    std::fs::remove_dir_all(&ckpt).unwrap();
    let raw = d.join("tessera-bench-raw.bin");
    std::fs::write(&raw, b"user data").unwrap();
    BIN.refused(&["--dir", dir, "--size", "2MiB", "--rounds", "1"], &raw);
    assert_eq!(std::fs::read(&raw).unwrap(), b"user data");
    std::fs::remove_file(&raw).unwrap();
    // An empty D/ckpt is the benchmark's to use (and remove).
    std::fs::create_dir_all(&ckpt).unwrap();
    BIN.expect(&["--async", "--dir", dir, "--budget", "1MiB", "--size", "2MiB", "--ranks", "2", "--rounds", "1"], 0);
    assert_eq!(std::fs::read_dir(d).unwrap().count(), 0);
}

#[test]
fn bench_s3_compares_with_a_local_directory() {
    let scratch = Scratch::new("bench-s3");
    let dir = scratch.path().to_str().unwrap();
    let url = s3::url("bench");
    let args = ["--dir", dir, "--s3", &url, "--size", "8MiB", "--ranks", "2"];
    let b = json(&BIN.s3().expect(&[&args[..], &["--rounds", "2", "--json"]].concat(), 0));
    assert_eq!((b["mode"].as_str(), b["url"].as_str(), b["load_ranks"].as_u64()), (Some("s3"), Some(&*url), Some(1)));
    for field in [
        "local_save_secs",
        "s3_save_secs",
        "local_load_secs",
        "s3_load_secs",
        "save_s3_vs_local",
        "load_s3_vs_local",
        "load_unverified_s3_vs_local",
    ] {
        assert!(b[field].as_f64().is_some_and(|x| x > 0.0), "{field}: {b}");
    }
    for field in ["save_s3_vs_local_rounds", "load_s3_vs_local_rounds", "load_unverified_s3_vs_local_rounds"] {
        assert_eq!(b[field].as_array().map(Vec::len), Some(2), "{field}: {b}");
    }
    // Every data file and the index: one PUT or multipart upload each, every byte once.
    let save = &b["save_requests"];
    assert!(save["puts"].as_u64().unwrap() + save["parts"].as_u64().unwrap() > b["files"].as_u64().unwrap(), "{b}");
    assert!(save["bytes_uploaded_vs_checkpoint"].as_f64().is_some_and(|x| (1.0..1.05).contains(&x)), "{b}");
    let chunks: u64 = b["chunk_reads_per_rank"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).sum();
    assert!(chunks >= b["chunks"].as_u64().unwrap(), "every stored chunk is read by some rank: {b}");
    for mode in ["load", "load_unverified"] {
        let l = &b[mode];
        assert_eq!(l["chunk_reads"].as_u64(), Some(chunks), "{mode}: {b}");
        assert_eq!(l["bytes_needed"], b["checkpoint_bytes"], "{mode}: the whole checkpoint, once: {b}");
        let r = l["bytes_downloaded_vs_needed"].as_f64().unwrap();
        assert!((1.0..=1.05).contains(&r), "{mode}: downloaded / needed {r}: {b}");
        assert!(l["gets"].as_u64() > l["tensor_data_gets"].as_u64(), "{mode}: {b}");
        assert!(l["gets_per_chunk"].as_f64().is_some_and(|x| x > 0.0), "{mode}: {b}");
    }
    assert_eq!(b["verified"], true);
    // Both checkpoints are removed.
    assert_eq!(std::fs::read_dir(scratch.path()).unwrap().count(), 0);
    assert_eq!(object_storage(&format!("{url}/ckpt")).list().unwrap(), Vec::<String>::new());

    // Text: every round, the medians, the requests.
    let out = BIN.s3().expect(&[&args[..], &["--rounds", "1", "--keep"]].concat(), 0);
    assert!(out.lines().any(|l| l.starts_with("round 1/1")), "{out}");
    assert!(out.lines().any(|l| l.starts_with("median") && l.contains("min–max")), "{out}");
    assert!(
        out.contains("PUTs") && out.contains("GETs per chunk") && out.contains("every loaded byte matched"),
        "{out}"
    );
    // --keep: both checkpoints of the last round stay, sound.
    assert_eq!(verify_dir(&scratch.path().join("ckpt")), Ok(vec![]));
    assert_eq!(verify(&object_storage(&format!("{url}/ckpt"))), Ok(vec![]));
}

#[test]
fn bench_modes_and_object_stores() {
    // The fully-parallel save runs on an object store too.
    let url = s3::url("bench-parallel");
    let args = ["--fully-parallel", "--dir", &url, "--size", "2MiB", "--dp", "2", "--rounds", "1", "--json"];
    let b = json(&BIN.s3().expect(&args, 0));
    assert_eq!(b["dir"], url.as_str());
    assert_eq!(b["runs"][0]["verified"], true, "{b}");
    // The raw-IO benchmark needs a local directory, and says what to use instead.
    let out = BIN.s3().run(&["--dir", &url, "--size", "2MiB"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("--s3"), "{}", text(&out.stderr));
    // --s3 is not a mode of --async or --plan-only.
    assert_eq!(BIN.run(&["--async", "--dir", "/tmp", "--s3", &url]).status.code(), Some(2));
}

#[test]
fn memory_tier_bench_reports_every_figure() {
    let scratch = Scratch::new("bench-memtier");
    let dir = scratch.path().join("persistent");
    let mem = scratch.path().join("memory");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::create_dir_all(&mem).unwrap();
    let args = ["--memory-tier", "--dir", dir.to_str().unwrap(), "--memory-root", mem.to_str().unwrap()];
    let b = json(&BIN.expect(&[&args[..], &["--size", "8MiB", "--rounds", "1", "--json"]].concat(), 0));
    for field in [
        "blocking_vs_memcpy",
        "commit_vs_memcpy",
        "memory_held_vs_state",
        "encode_bytes_per_sec_per_core",
        "disk_load_vs_restore",
        "disk_load_vs_restore_nothing_lost",
        "steps_lost_persistent_every_8",
    ] {
        assert!(b[field].as_f64().is_some_and(|x| x > 0.0), "{field}: {b}");
    }
    // RS(2, 2) holds twice the state (copies and parity), not the 3× of two full replicas.
    let held = b["memory_held_vs_state"].as_f64().unwrap();
    assert!((1.9..2.2).contains(&held), "{b}");
    assert_eq!(b["replicas_for_same_loss"].as_f64(), Some(3.0));
    // Nothing is left in the memory roots or the persistent directory.
    assert_eq!(std::fs::read_dir(&mem).unwrap().count(), 0);
}
