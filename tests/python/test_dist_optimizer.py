"""Distributed-optimizer buffers saved as model-space flat ranges (``dist_optimizer``): the
mapping on hand-computed offsets, and a TP=2 x DP=4 save loaded at TP=1 x DP=2 and at 1 rank
on gloo process groups, compared element by element with the unsharded truth."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import pytest
import torch

from tessera._launch import run_ranks
from tessera import dist_checkpointing as dc
from tessera.dist_checkpointing import CheckpointingException, ParamRange, ShardedTensor

STATES = ("exp_avg", "exp_avg_sq")
PREFIX = "optimizer.state"
# Global model: key -> (global shape, TP-split axis in the global tensor or None, prepend_axis_num).
# "layers.fc" is two stacked layers (axis 0 is the layer index), "norm" is replicated across TP.
MODEL = {
    "w_col": ((12, 10), 0, 0),
    "w_row": ((10, 12), 1, 0),
    "layers.fc": ((2, 8, 6), 1, 1),
    "norm": ((10,), None, 0),
}


def truth() -> Dict[str, Dict[str, torch.Tensor]]:
    """state -> key -> the unsharded f32 optimizer state, identical in every process."""
    g = torch.Generator().manual_seed(2024)
    return {s: {k: torch.randn(shape, generator=g) for k, (shape, _, _) in MODEL.items()} for s in STATES}


def model_params(tp: int, tp_rank: int, dp_rank: int) -> List[ShardedTensor]:
    """The model-space ShardedTensors of one TP rank's parameters (bf16 params, replica ids
    (PP, TP, DP) as Megatron builds them), in the order the optimizer packs them."""
    out = []
    for key, (shape, split, prepend) in MODEL.items():
        layers = range(shape[0]) if prepend else [None]
        for layer in layers:
            local = list(shape[prepend:])
            offsets: List[Tuple[int, int, int]] = []
            if layer is not None:
                offsets.append((0, layer, shape[0]))
            if split is not None:
                local[split - prepend] //= tp
                offsets.append((split, tp_rank, tp))
            replica = (0, 0 if split is not None else tp_rank, dp_rank)
            param = torch.empty(local, dtype=torch.bfloat16)
            out.append(ShardedTensor.from_rank_offsets(key, param, *offsets, replica_id=replica, prepend_axis_num=prepend))
    return out


def local_box(full: torch.Tensor, param: ShardedTensor) -> torch.Tensor:
    """The part of the global tensor that a model param's local box covers."""
    return full[param.global_slice()]


def full_buffer(params: List[ParamRange], total: int, state: str, padding: float) -> torch.Tensor:
    """One TP rank's full flat buffer of ``state`` filled from the truth, padding set to ``padding``."""
    buf = torch.full((total,), padding)
    want = truth()[state]
    for p in params:
        buf[p.start : p.end] = local_box(want[p.param.key], p.param).reshape(-1)
    return buf


def layout(tp: int, tp_rank: int, dp_rank: int, dp: int, param_alignment: int, reverse: bool) -> Tuple[List[ParamRange], int]:
    params = model_params(tp, tp_rank, dp_rank)
    if reverse:  # Megatron packs a bucket in reverse order
        params = params[::-1]
    lay = dc.param_buffer_layout(params, dp, param_alignment=param_alignment, bucket_alignment=param_alignment)
    return lay.param_ranges(params), lay.total


def padding_mask(params: List[ParamRange], total: int) -> torch.Tensor:
    used = torch.zeros(total, dtype=torch.bool)
    for p in params:
        used[p.start : p.end] = True
    return ~used


# ---------------------------------------------------------------------------------------------
# Unit tests of the mapping


def hand_params() -> List[ParamRange]:
    """a (2,3) at [0,6), gap, b (4,) at [8,12), c (3,2) at [12,18), padding [18,20): 4 shards of 5."""
    a = ShardedTensor.from_rank_offsets("a", torch.empty(2, 3), (0, 1, 2), replica_id=(0, 0, 3))
    b = ShardedTensor.from_rank_offsets("b", torch.empty(4), replica_id=(0, 1, 3))
    c = ShardedTensor.from_rank_offsets("c", torch.empty(1, 3, 2), (0, 1, 4), prepend_axis_num=1, replica_id=2)
    return [ParamRange(a, 0, 6), ParamRange(b, 8, 12), ParamRange(c, 12, 18)]


def test_param_buffer_layout_pads_starts_and_end() -> None:
    lay = dc.param_buffer_layout([(2, 3), torch.empty(4), 6], 4, param_alignment=4, bucket_alignment=1)
    assert lay.ranges == ((0, 6), (8, 12), (12, 18)) and lay.total == 20 and lay.shard_size == 5
    assert lay.shard_range(3) == (15, 20)
    # Megatron's defaults: starts at multiples of 64, end at a multiple of dp * 128.
    lay = dc.param_buffer_layout([100, 1, 30], 2)
    assert lay.ranges == ((0, 100), (128, 129), (192, 222)) and lay.total == 256
    assert dc.param_buffer_layout([], 3).total == 0


# dp_rank -> [(key, buffer [lo, hi), flattened_range)], computed by hand from hand_params().
EXPECTED = {
    0: [("a", (0, 5), (0, 5))],
    1: [("a", (5, 6), (5, 6)), ("b", (8, 10), (0, 2))],
    2: [("b", (10, 12), (2, 4)), ("c", (12, 15), (0, 3))],
    3: [("c", (15, 18), (3, 6))],
}


@pytest.mark.parametrize("dp_rank", range(4))
def test_mapping_on_hand_computed_offsets(dp_rank: int) -> None:
    full = torch.arange(20, dtype=torch.float32)
    shard = full[dp_rank * 5 : (dp_rank + 1) * 5].clone()
    params = hand_params()
    out = dc.dist_optimizer_sharded_tensors(shard, dp_rank, 4, params[::-1], "optimizer.state.exp_avg.")
    assert [(sh.key, (sh.flattened_range.start, sh.flattened_range.stop)) for sh in out] == [
        (f"optimizer.state.exp_avg.{k}", fr) for k, _, fr in EXPECTED[dp_rank]
    ]
    by_key = {p.param.key: p.param for p in params}
    for sh, (key, (lo, hi), _) in zip(out, EXPECTED[dp_rank]):
        model = by_key[key]
        assert torch.equal(sh.data, full[lo:hi])
        # A view of the shard, not a copy.
        assert sh.data.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
        assert sh.data.data_ptr() == shard.data_ptr() + (lo - dp_rank * 5) * shard.element_size()
        assert sh.dtype == torch.float32
        assert (sh.local_shape, sh.global_shape, sh.global_offset, sh.axis_fragmentations, sh.prepend_axis_num) == (
            model.local_shape, model.global_shape, model.global_offset, model.axis_fragmentations,
            model.prepend_axis_num,
        )
    # The DP coordinate of tuple replica ids is zeroed, the TP one kept; int replica ids are kept.
    replicas = {sh.key.rsplit(".", 1)[1]: sh.replica_id for sh in out}
    assert replicas.get("a", (0, 0, 0)) == (0, 0, 0)
    assert replicas.get("b", (0, 1, 0)) == (0, 1, 0)
    assert replicas.get("c", 2) == 2


def test_mapping_writes_through_to_the_shard() -> None:
    shard = torch.zeros(5)
    out = dc.dist_optimizer_state_dict({"exp_avg": shard}, 2, 4, hand_params(), dp_replica_axis=None)
    assert [sh.key for sh in out["exp_avg"]] == ["optimizer.state.exp_avg.b", "optimizer.state.exp_avg.c"]
    assert out["exp_avg"][0].replica_id == (0, 1, 3)
    out["exp_avg"][1].data.fill_(7.0)
    assert torch.equal(shard, torch.tensor([0.0, 0.0, 7.0, 7.0, 7.0]))


def test_mapping_rejects_inconsistent_layouts() -> None:
    a, b, _ = hand_params()
    with pytest.raises(CheckpointingException, match="overlap"):
        dc.dist_optimizer_sharded_tensors(torch.zeros(5), 0, 4, [a, ParamRange(b.param, 4, 8)], "p.")
    with pytest.raises(CheckpointingException, match="holds 5 elements"):
        dc.dist_optimizer_sharded_tensors(torch.zeros(5), 0, 4, [ParamRange(a.param, 0, 5)], "p.")
    with pytest.raises(CheckpointingException, match="outside"):
        dc.dist_optimizer_sharded_tensors(torch.zeros(5), 0, 4, [ParamRange(b.param, 18, 22)], "p.")
    with pytest.raises(CheckpointingException, match="dp_rank"):
        dc.dist_optimizer_sharded_tensors(torch.zeros(5), 4, 4, [a], "p.")
    with pytest.raises(CheckpointingException, match="1-D"):
        dc.dist_optimizer_sharded_tensors(torch.zeros(5, 1), 0, 4, [a], "p.")
    with pytest.raises(CheckpointingException, match="ShardedTensor"):
        dc.dist_optimizer_sharded_tensors(torch.zeros(5), 0, 4, [(torch.zeros(2, 3), 0, 6)], "p.")


def test_layout_covers_every_element_once() -> None:
    """Over all TP x DP ranks, the main-replica flat ranges tile each global tensor exactly."""
    for tp, dp, align, reverse in ((2, 4, 8, True), (1, 2, 16, False), (2, 3, 1, False)):
        counts = {k: torch.zeros(shape, dtype=torch.int32) for k, (shape, _, _) in MODEL.items()}
        for tp_rank in range(tp):
            for dp_rank in range(dp):
                params, total = layout(tp, tp_rank, dp_rank, dp, align, reverse)
                shard = torch.empty(total // dp)
                for sh in dc.dist_optimizer_sharded_tensors(shard, dp_rank, dp, params, ""):
                    if dc.is_main_replica(sh.replica_id):
                        counts[sh.key][sh.global_coordinates()] += 1
        for key, c in counts.items():
            assert bool((c == 1).all()), (tp, dp, key)


# ---------------------------------------------------------------------------------------------
# Multi-process save and resharded loads

SAVE_TP, SAVE_DP, SAVE_ALIGN = 2, 4, 8


def _save(rank: int, world: int, ckpt: str) -> None:
    tp_rank, dp_rank = rank % SAVE_TP, rank // SAVE_TP
    params, total = layout(SAVE_TP, tp_rank, dp_rank, SAVE_DP, SAVE_ALIGN, reverse=True)
    lo, hi = dc.dp_shard_range(total, SAVE_DP, dp_rank)
    # NaN padding: any padding element that got saved would break the comparisons.
    shards = {s: full_buffer(params, total, s, float("nan"))[lo:hi].clone() for s in STATES}
    sd: Dict[str, Any] = {"optimizer": dc.dist_optimizer_state_dict(shards, dp_rank, SAVE_DP, params, PREFIX)}
    sd["iteration"] = 11
    dc.save(sd, ckpt)


def _load_tp1_dp2(rank: int, world: int, ckpt: str) -> None:
    dp_rank, dp = rank, world
    params, total = layout(1, 0, dp_rank, dp, 16, reverse=False)
    lo, hi = dc.dp_shard_range(total, dp, dp_rank)
    shards = {s: torch.zeros(hi - lo) for s in STATES}
    request = dc.dist_optimizer_state_dict(shards, dp_rank, dp, params, PREFIX)
    partial = [sh for v in request.values() for sh in v if sh.flattened_range != slice(0, math.prod(sh.local_shape))]
    assert partial, "no DP boundary inside a parameter"
    state = dc.load({"optimizer": request}, ckpt, strict=dc.StrictHandling.RAISE_UNEXPECTED)
    assert state["iteration"] == 11
    mask = padding_mask(params, total)[lo:hi]
    for s in STATES:
        want = full_buffer(params, total, s, 0.0)[lo:hi]
        # Loaded in place into the shard: the optimizer's own buffer holds the state.
        assert torch.equal(shards[s], want), s
        assert bool((shards[s][mask] == 0).all()), "padding was written"
        for sh, got in zip(request[s], state["optimizer"][s]):
            assert got.data_ptr() == sh.data.data_ptr()


@pytest.fixture(scope="module")
def tp2_dp4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    ckpt = str(tmp_path_factory.mktemp("distopt") / "tp2dp4")
    run_ranks(SAVE_TP * SAVE_DP, _save, ckpt)
    return ckpt


def test_save_splits_parameters_mid_range() -> None:
    """The save layout really has DP boundaries inside parameters and padding at both places."""
    params, total = layout(SAVE_TP, 0, 0, SAVE_DP, SAVE_ALIGN, reverse=True)
    shard = total // SAVE_DP
    bounds = [d * shard for d in range(1, SAVE_DP)]
    assert sum(any(p.start < b < p.end for p in params) for b in bounds) >= 2
    gaps = padding_mask(params, total)
    assert bool(gaps[-1]) and int(gaps.sum()) > int(gaps[params[-1].end :].numel())


def test_tp2_dp4_loads_at_tp1_dp2(tp2_dp4_checkpoint: str) -> None:
    run_ranks(2, _load_tp1_dp2, tp2_dp4_checkpoint)


def test_tp2_dp4_loads_in_one_process_as_full_tensors(tp2_dp4_checkpoint: str) -> None:
    want = truth()
    plain = dc.load_plain_tensors(tp2_dp4_checkpoint)
    assert set(plain) == {f"{PREFIX}.{s}.{k}" for s in STATES for k in MODEL}
    for s in STATES:
        for key, t in want[s].items():
            got = plain[f"{PREFIX}.{s}.{key}"]
            assert got.dtype == torch.float32 and torch.equal(got, t), (s, key)
    meta = dc.load_tensors_metadata(tp2_dp4_checkpoint)
    assert tuple(meta[f"{PREFIX}.exp_avg.layers.fc"].global_shape) == MODEL["layers.fc"][0]


def test_tp2_dp4_loads_at_one_rank_through_the_helper(tp2_dp4_checkpoint: str) -> None:
    """TP=1 x DP=1: the whole buffer is one shard; full-box ShardedTensors with flat ranges."""
    params, total = layout(1, 0, 0, 1, 1, reverse=False)
    shards = {s: torch.zeros(total) for s in STATES}
    request = dc.dist_optimizer_state_dict(shards, 0, 1, params, PREFIX)
    assert all(sh.flattened_range == slice(0, math.prod(sh.local_shape)) for v in request.values() for sh in v)
    dc.load({"optimizer": request}, tp2_dp4_checkpoint)
    for s in STATES:
        assert torch.equal(shards[s], full_buffer(params, total, s, 0.0)), s
