use tessera::*;

fn fill(key: &str, n: usize) -> Vec<f32> {
    let h = key.bytes().fold(0u32, |a, b| a.wrapping_mul(31).wrapping_add(b as u32));
    (0..n).map(|i| (h % 1000) as f32 + i as f32).collect()
}

fn bytes(v: &[f32]) -> &[u8] {
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 4) }
}

#[test]
fn save_tp4_load_tp2_and_flat() {
    let dir = std::env::temp_dir().join(format!("tessera-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let global = fill("w", 8 * 6);
    // Save: 4 ranks, rows split by 4 ("w"), plus "b" flat-range split over 4 ranks.
    let d2 = dir.clone();
    let g2 = global.clone();
    InProcessComm::run(4, move |c| {
        let r = c.rank();
        let rows = &g2[r * 12..(r + 1) * 12];
        let st = StateTree::map()
            .with(
                "w",
                StateTree::Tensor(
                    ShardedTensor::from_rank_offsets("w", DType::F32, &[2, 6], TensorData::Ref(bytes(rows)), &[(0, r as u64, 4)], 0).unwrap(),
                ),
            )
            .with(
                "b",
                StateTree::Tensor(
                    ShardedTensor::full("b", DType::F32, &[8, 6], TensorData::Ref(bytes(&g2[r * 12..r * 12 + 12])))
                        .with_flattened_range(r as u64 * 12..r as u64 * 12 + 12),
                ),
            )
            .with("step", StateTree::Value(Value::Int(7)));
        let storage = LocalStorage::new(&d2);
        save(st, &storage, c, &SaveOptions { block_size: 16, ..Default::default() }).unwrap()
    });
    // Load: 2 ranks, column split of "w", odd flat ranges of "b".
    let storage = LocalStorage::new(&dir);
    for r in 0..2u64 {
        let mut w = vec![0f32; 8 * 3];
        let mut b = vec![0f32; 17];
        let wb = unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr() as *mut u8, w.len() * 4) };
        let bb = unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut u8, b.len() * 4) };
        let st = StateTree::map()
            .with("w", StateTree::Tensor(ShardedTensor::from_rank_offsets("w", DType::F32, &[8, 3], TensorData::Mut(wb), &[(1, r, 2)], 0).unwrap()))
            .with(
                "b",
                StateTree::Tensor(ShardedTensor::full("b", DType::F32, &[8, 6], TensorData::Mut(bb)).with_flattened_range(5 + r * 17..22 + r * 17)),
            );
        let res = load(st, &storage, &SoloComm, &LoadOptions::default()).unwrap();
        assert_eq!(res.state.get_dotted("step").unwrap().as_value(), Some(&Value::Int(7)));
        for i in 0..8 {
            for j in 0..3 {
                assert_eq!(w[i * 3 + j], global[i * 6 + r as usize * 3 + j]);
            }
        }
        assert_eq!(&b[..], &global[5 + r as usize * 17..22 + r as usize * 17]);
    }
    let plain = load_plain_tensors(&storage, None).unwrap();
    assert_eq!(plain["w"].data, bytes(&global));
    let rep = verify(&storage, 2).unwrap();
    assert!(rep.problems.is_empty(), "{:?}", rep.problems);
    std::fs::remove_dir_all(&dir).unwrap();
}
