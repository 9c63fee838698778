#!/usr/bin/env bash
# Seeds the fuzz corpora fuzz/corpus/TARGET from the test fixtures (crates/tessera/tests/fixtures),
# in the input layout each target reads (see the comment at the top of fuzz/fuzz_targets/*.rs):
#   index        golden v1/v2 tessera.index, and edit scripts applied to them
#   safetensors  golden data files, small OLMo rank files and expected exports
#   dcp          [fixture u8] .metadata (the byte picks the data files the target pairs it with)
#   zip          torch.save archives: Megatron common.pt, sharded-object .pt, OLMo-core train
#                state, and the items cut out of DCP .distcp files
#   zarr         [array u8] .zarray (the byte picks the array of megatron_zarr it replaces)
#   olmo         [len_a u16][len_b u16] metadata.json | rank_0 | rank_1
#   unpickle     DCP .metadata pickles, Megatron common pickles (the rest is hand-written)
# Idempotent: rewrites the seeds it makes, leaves other files alone. Keeps every corpus small
# (< 1 MB in all); commit what it writes.
set -euo pipefail
cd "$(dirname "$0")/../.."
fx=crates/tessera/tests/fixtures
foreign=$fx/foreign
out=fuzz/corpus
mkdir -p "$out"/{index,safetensors,dcp,zip,zarr,olmo,unpickle,tier_manifest}

# index
cp "$fx/golden_v1/tessera.index" "$out/index/golden_v1.index"
cp "$fx/golden_v2/tessera.index" "$out/index/golden_v2.index"
# Edit scripts (an input that is not an index): [golden v1/v2 u8] then [op][which][dim][value].
printf '\x00' >"$out/index/edit_v1_none"
printf '\x01' >"$out/index/edit_v2_none"
printf '\x01\x01\x00\x00\x05' >"$out/index/edit_v2_byte_offset"
printf '\x00\x03\x02\x01\x07' >"$out/index/edit_v1_shape"
printf '\x01\x84\x03\x00\x02\x00\x00\x00\x09' >"$out/index/edit_v2_flat"
printf '\x01\x09\x01\x00\x00\x0b\x00\x00\x40' >"$out/index/edit_v2_repeat_chunk_file_size"
printf '\x01\x0f\x00\x00\x11' >"$out/index/edit_v2_object_offset"

# safetensors
for v in 1 2; do
    for f in "$fx"/golden_v$v/*.safetensors; do
        cp "$f" "$out/safetensors/golden_v${v}_$(basename "$f" | sed 's/.*-//')"
    done
done
cp "$fx/olmo/olmo_single/rank_0.safetensors" "$out/safetensors/olmo_single_rank_0.safetensors"
cp "$fx/olmo/olmo_dtensor2d_w4/rank_0.safetensors" "$out/safetensors/olmo_dtensor2d_rank_0.safetensors"
cp "$fx/olmo/olmo_ddp_w2/model/rank_1.safetensors" "$out/safetensors/olmo_empty_rank.safetensors"
# DCP's distributed HF shards: rank 1's file, read beside rank 2's real one by the target.
cp "$foreign/dcp_hf_sharded/shard-00001-model-00001-of-00001.safetensors" "$out/safetensors/dcp_hf_sharded_shard_1.safetensors"
for x in dcp_legacy dcp_per_item megatron_common_item megatron_zarr; do
    cp "$foreign/$x.expected.safetensors" "$out/safetensors/$x.expected.safetensors"
done

# dcp: the fixture byte is the position in fuzz/fuzz_targets/dcp.rs's FIXTURES.
dcp_seed() { # NAME BYTE METADATA
    { printf "\\x$(printf %02x "$2")"; cat "$3"; } >"$out/dcp/$1"
}
dcp_seed dcp_single 0 "$foreign/dcp_single/.metadata"
dcp_seed dcp_zstd 1 "$foreign/dcp_zstd/.metadata"
dcp_seed dcp_legacy 2 "$foreign/dcp_legacy/.metadata"
dcp_seed megatron_tp2_dp2 3 "$foreign/megatron_tp2_dp2/.metadata"
dcp_seed megatron_common_item 4 "$foreign/megatron_common_item/.metadata"
dcp_seed olmo_core 6 "$foreign/olmo_core/model_and_optim/.metadata"
dcp_seed megatron_core019 5 "$foreign/megatron_core019/.metadata"
# The target also parses its input (after the fixture byte) as Megatron's integrity.json.
dcp_seed megatron_core019_integrity 5 "$foreign/megatron_core019/integrity.json"
# A save without collectives: each rank's metadata as the input, beside rank 1's real one.
dcp_seed dcp_no_collectives 7 "$foreign/dcp_no_collectives/__0.metadata"
dcp_seed dcp_no_collectives_rank1 7 "$foreign/dcp_no_collectives/__1.metadata"
# Parser coverage only (paired with dcp_single's data files).
dcp_seed dcp_per_item 0 "$foreign/dcp_per_item/.metadata"
dcp_seed dcp_mesh2d 0 "$foreign/dcp_mesh2d/.metadata"
dcp_seed dcp_fsdp2 0 "$foreign/dcp_fsdp2/.metadata"

# zip
cp "$foreign/megatron_tp2_dp2/common.pt" "$out/zip/megatron_common.pt"
cp "$foreign/megatron_zarr/rng_state/shard_0_4.pt" "$out/zip/megatron_object_shard.pt"
cp "$foreign/olmo_core/train/rank0.pt" "$out/zip/olmo_train_rank0.pt"
# Each DCP item not zstd-compressed is a whole torch.save archive; it ends with its zip end
# record (22 bytes, no comment), so the file splits there.
python3 - "$out/zip" "$foreign" <<'PY'
import sys, pathlib
out, foreign = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for fixture, files in [("dcp_single", ["__0_0.distcp"]), ("megatron_common_item", ["__0_0.distcp"]),
                       ("dcp_per_item", ["__0_2.distcp", "__1_4.distcp"]), ("dcp_legacy", ["__0_0.distcp"])]:
    for f in files:
        data = (foreign / fixture / f).read_bytes()
        start, n = 0, 0
        while (end := data.find(b"PK\x05\x06", start)) >= 0:
            item = data[start:end + 22]
            if item.startswith(b"PK\x03\x04") and len(item) <= 16 << 10:
                (out / f"{fixture}_{f.split('.')[0]}_item{n}.pt").write_bytes(item)
            start, n = end + 22, n + 1
PY

# zarr: the array byte is the position in fuzz/fuzz_targets/zarr.rs's ARRAYS.
n=0
for a in decoder.final_norm.weight decoder/layers.fc1.weight embedding.word_embeddings.weight step_counts; do
    { printf "\\x$(printf %02x $n)"; cat "$foreign/megatron_zarr/$a/.zarray"; } >"$out/zarr/$(basename "$a")"
    n=$((n + 1))
done

# olmo: two rank files at most (the target's layout).
olmo_seed() { # NAME DIR
    local a="$2/rank_0.safetensors" b="$2/rank_1.safetensors"
    [ -f "$b" ] || b=/dev/null
    python3 -c 'import struct, sys; sys.stdout.buffer.write(struct.pack("<HH", *map(int, sys.argv[1:])))' \
        "$(stat -c %s "$a")" "$(stat -c %s "$b")" >"$out/olmo/$1"
    cat "$2/metadata.json" "$a" "$b" >>"$out/olmo/$1"
}
for c in olmo_ddp_w2 olmo_fsdp1_w2 olmo_fsdp2_w2; do
    olmo_seed "${c}_model" "$fx/olmo/$c/model"
    olmo_seed "${c}_optim" "$fx/olmo/$c/optim"
done
olmo_seed olmo_single "$fx/olmo/olmo_single"

# unpickle
cp "$foreign/dcp_single/.metadata" "$out/unpickle/dcp_single.metadata"
cp "$foreign/megatron_tp2_dp2/.metadata" "$out/unpickle/dcp_megatron_tp2_dp2.metadata"
cp crates/tessera/src/format/testdata/megatron_common_data.pkl crates/tessera/src/format/testdata/torch_save_data.pkl \
    "$out/unpickle/"

du -sh "$out"/*

# tier_manifest: [lost-nodes mask][0][a marker as written], and [mask][1][its body alone].
python3 - "$out/tier_manifest" "$fx/golden_memory_tier_v1" <<'PY'
import json, pathlib, sys
out, golden = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
marker = sorted(golden.glob("node0/step-*/commit-*.json"))[0].read_bytes()
body = json.loads(marker)["body"].encode()
for mask in (0, 1, 3, 7):
    (out / f"golden_marker_lost{mask}").write_bytes(bytes([mask, 0]) + marker)
    (out / f"golden_body_lost{mask}").write_bytes(bytes([mask, 1]) + body)
PY
