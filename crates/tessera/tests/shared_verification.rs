//! Verification shared between ranks (`LoadOptions::share_verification`, on by default with
//! more than one rank): from remote storage a rank reads only the bytes it needs, every
//! checksum block it touches is still checked whole, a damaged byte anywhere in such a block
//! fails the load of every rank that touched it, and a failure on one rank before the swap of
//! checksums fails all of them. From a local file every rank reads whole blocks, alone.
//!
//! The checkpoints are directories treated as not local, as on a network filesystem.

use crate::common::*;
use tessera::storage::*;
use tessera::*;

/// `w`: 64 rows of 256 f32 (1 KiB each), checksummed in blocks of 4 rows.
const ROWS: u64 = 64;
const COLS: u64 = 256;
const BLOCK: u64 = 4096;

/// Saves `w` split by rows from 2 ranks, and `b` (64 f32) whole from rank 0, to a directory.
fn saved() -> (TempDir, Vec<u8>, Vec<u8>) {
    let dir = TempDir::new("shared-verification");
    let w = seeded_truth(DType::F32, &[ROWS, COLS], 3);
    let b = seeded_truth(DType::F32, &[64], 4);
    let storage = LocalStorage::new(dir.path());
    let out = run_ranks(2, |c| {
        let r = c.rank() as u64;
        let half = (ROWS / 2 * COLS * 4) as usize;
        let mine = TensorData::Ref(&w[r as usize * half..][..half]);
        let rows = ShardedTensor::from_rank_offsets("w", DType::F32, &[ROWS / 2, COLS], mine, &[(0, r, 2)], 0)?;
        let mut tree = StateTree::map().with("w", StateTree::Tensor(rows));
        if r == 0 {
            tree.insert("b", StateTree::Tensor(ShardedTensor::full("b", DType::F32, &[64], TensorData::Ref(&b))));
        }
        save(tree, &storage, c, &small_blocks(BLOCK))
    });
    for x in out {
        x.unwrap();
    }
    (dir, w, b)
}

/// Rank `r` of `parts` asks for columns `[r, r + 1) * COLS / parts` of every row of `w`
/// (`None` when `r` asks for nothing of `w`), and rank 0 for `b` too.
fn request(r: usize, parts: Option<u64>) -> StateTree<'static> {
    let mut tree = StateTree::map();
    if let Some(parts) = parts {
        let cols = ShardedTensor::from_rank_offsets(
            "w",
            DType::F32,
            &[ROWS, COLS / parts],
            TensorData::None,
            &[(1, r as u64, parts)],
            0,
        )
        .unwrap();
        tree.insert("w", StateTree::Tensor(cols));
    }
    if r == 0 {
        tree.insert("b", StateTree::Tensor(ShardedTensor::full("b", DType::F32, &[64], TensorData::None)));
    }
    tree
}

/// Columns `[c0, c1)` of every row of `w`.
fn columns(w: &[u8], c0: u64, c1: u64) -> Vec<u8> {
    box_bytes(w, &[ROWS, COLS], 4, &[0, c0], &[ROWS, c1 - c0])
}

/// Where `w`'s byte `at` (row-major) lies: its file and offset.
fn file_byte_of_w(storage: &LocalStorage, at: u64) -> (String, u64) {
    let ckpt = open(storage).unwrap();
    let index = ckpt.index();
    let t = index.tensors.iter().find(|t| t.key == "w").unwrap();
    let row = at / (COLS * 4);
    let c = t.chunks().iter().find(|c| c.offset[0] <= row && row < c.offset[0] + c.shape[0]).unwrap();
    let within = at - c.offset[0] * COLS * 4;
    (index.files[c.file as usize].name.clone(), c.byte_offset + within)
}

fn flip(path: &std::path::Path, at: u64) {
    let mut b = std::fs::read(path).unwrap();
    b[at as usize] ^= 0x5a;
    std::fs::write(path, b).unwrap();
}

#[test]
fn each_rank_reads_only_what_it_needs_and_the_blocks_are_still_checked() {
    let (dir, w, b) = saved();
    let storage = LocalStorage::new(dir.path()).treat_as_local(false);
    for share in [true, false] {
        let opts = LoadOptions { share_verification: share, ..load_opts() };
        let out = run_ranks(2, |c| {
            let counting = CountingComm::new(c);
            let res = load(request(c.rank(), Some(2)), &storage, &counting, &opts)?;
            let calls = counting.calls.load(std::sync::atomic::Ordering::Relaxed);
            Ok::<_, Error>((bytes_at(&res.state, "w").to_vec(), res.state.get_dotted("b").is_some(), res.stats, calls))
        });
        for (r, x) in out.into_iter().enumerate() {
            let ctx = format!("shared {share}, rank {r}");
            let (got, has_b, stats, calls) = x.unwrap_or_else(|e| panic!("{ctx}: {e}"));
            let half = COLS / 2;
            assert!(got == columns(&w, r as u64 * half, (r as u64 + 1) * half), "{ctx}: wrong bytes");
            assert_eq!(has_b, r == 0, "{ctx}");
            let needed = ROWS * half * 4 + if r == 0 { b.len() as u64 } else { 0 };
            assert_eq!(stats.bytes_needed, needed, "{ctx}");
            assert!(stats.header_bytes_read > 0, "{ctx}");
            if share {
                // Half of every row, and b (a block rank 0 alone touches and needs whole).
                assert_eq!(stats.bytes_read, needed, "{ctx}");
                // One all-gather of the needs, one all-to-all of checksums.
                assert_eq!(calls, 2, "{ctx}");
            } else {
                // Every block of w touched is read whole.
                assert_eq!(stats.bytes_read, needed + ROWS * half * 4, "{ctx}");
                assert_eq!(calls, 0, "{ctx}");
            }
        }
    }
}

#[test]
fn bytes_nobody_needs_are_read_once_to_check_their_blocks() {
    let (dir, w, _) = saved();
    let storage = LocalStorage::new(dir.path()).treat_as_local(false);
    // Ranks 0 and 1 take the first two quarters of the columns, rank 2 asks for nothing of w:
    // the other half of every row is needed by nobody, read once by rank 0.
    let out = run_ranks(3, |c| {
        let parts = (c.rank() < 2).then_some(4);
        load(request(c.rank(), parts), &storage, c, &load_opts()).map(|res| {
            let got = res.state.get_dotted("w").map(|_| bytes_at(&res.state, "w").to_vec());
            (got, res.stats)
        })
    });
    let quarter = COLS / 4;
    let mut read = 0;
    for (r, x) in out.into_iter().enumerate() {
        let (got, stats) = x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        match got {
            Some(got) => assert!(got == columns(&w, r as u64 * quarter, (r as u64 + 1) * quarter), "rank {r}"),
            None => assert_eq!(r, 2),
        }
        read += stats.bytes_read - if r == 0 { 64 * 4 } else { 0 };
    }
    assert_eq!(read, ROWS * COLS * 4, "every byte of w read once by the group");
}

#[test]
fn a_damaged_byte_fails_every_rank_whose_blocks_it_is_in() {
    // A byte of row 5 needed by rank 1 only (column 200); a byte of row 9 needed by nobody
    // (column 250, with the three-rank request above).
    for (row, col, world) in [(5u64, 200u64, 2usize), (9, 250, 3)] {
        let (dir, _, _) = saved();
        let storage = LocalStorage::new(dir.path()).treat_as_local(false);
        let (file, at) = file_byte_of_w(&storage, (row * COLS + col) * 4);
        flip(&dir.join(&file), at);
        let out = run_ranks(world, |c| {
            let parts = if world == 2 { Some(2) } else { (c.rank() < 2).then_some(4) };
            load(request(c.rank(), parts), &storage, c, &load_opts()).map(|r| r.stats)
        });
        for (r, x) in out.into_iter().enumerate() {
            let ctx = format!("row {row}, column {col}, rank {r} of {world}");
            match x {
                // Rank 2 of 3 touches none of w.
                Ok(_) if world == 3 && r == 2 => {}
                Err(Error::Corrupt { path, reason }) => {
                    assert!(path.to_string_lossy().ends_with(&file), "{ctx}: {path:?}");
                    assert!(reason.contains("checksum mismatch in \"w\""), "{ctx}: {reason}");
                }
                other => panic!("{ctx}: {other:?}"),
            }
        }
        // Without sharing, only the rank reading the damaged block whole sees it: rank 0 reads
        // row 5 whole too (it needs part of its block).
        if world == 2 {
            let opts = LoadOptions { share_verification: false, ..load_opts() };
            let out = run_ranks(2, |c| load(request(c.rank(), Some(2)), &storage, c, &opts).map(|r| r.stats));
            assert!(out.iter().all(|x| matches!(x, Err(Error::Corrupt { .. }))), "{out:?}");
        }
    }
}

#[test]
fn a_rank_failing_before_the_swap_fails_them_all() {
    let (dir, _, _) = saved();
    let storage = LocalStorage::new(dir.path()).treat_as_local(false);
    let opts = LoadOptions { strict: StrictHandling::RaiseUnexpected, ..load_opts() };
    let out = run_ranks(2, |c| {
        let mut tree = request(c.rank(), Some(2));
        if c.rank() == 1 {
            tree.insert("x", StateTree::Tensor(ShardedTensor::full("nope", DType::F32, &[2], TensorData::None)));
        }
        load(tree, &storage, c, &opts).map(|r| r.stats)
    });
    assert!(matches!(out[1], Err(Error::KeyMismatch { .. })), "{:?}", out[1]);
    assert!(matches!(out[0], Err(Error::PeerFailed { rank: 1, .. })), "{:?}", out[0]);
}

#[test]
fn from_a_local_file_every_rank_reads_whole_blocks_alone() {
    let (dir, w, _) = saved();
    let storage = LocalStorage::new(dir.path());
    assert!(storage.is_local());
    let out = run_ranks(2, |c| {
        let counting = CountingComm::new(c);
        let res = load(request(c.rank(), Some(2)), &storage, &counting, &load_opts())?;
        let calls = counting.calls.load(std::sync::atomic::Ordering::Relaxed);
        Ok::<_, Error>((bytes_at(&res.state, "w").to_vec(), res.stats, calls))
    });
    for (r, x) in out.into_iter().enumerate() {
        let (got, stats, calls) = x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        let half = COLS / 2;
        assert!(got == columns(&w, r as u64 * half, (r as u64 + 1) * half), "rank {r}: wrong bytes");
        // Only the all-gather in which the ranks learn that one reads a local file.
        assert_eq!(calls, 1, "rank {r}");
        let of_w = ROWS * half * 4;
        assert_eq!(stats.bytes_read - (stats.bytes_needed - of_w), 2 * of_w, "rank {r}");
    }
}
