"""Mapping classes of tessera.dist_checkpointing: geometry, validation, factories, dtypes."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.dist_checkpointing import (
    CheckpointingException,
    LocalNonpersistentObject,
    LocalNonpersitentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
    validate_sharding_integrity,
)
from tessera._core.dtypes import (
    TESSERA_DTYPES,
    numpy_dtype_to_tessera,
    tessera_dtype_to_numpy,
    tessera_dtype_to_torch,
    to_tessera_dtype,
    torch_dtype_to_tessera,
)

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"


# ---------------------------------------------------------------------------------------------
# ShardedTensor.from_rank_offsets


def test_from_rank_offsets_without_offsets_is_the_whole_tensor():
    t = torch.zeros(3, 5)
    sh = ShardedTensor.from_rank_offsets("w", t)
    assert sh.local_shape == (3, 5)
    assert sh.global_shape == (3, 5)
    assert sh.global_offset == (0, 0)
    assert sh.axis_fragmentations == (1, 1)
    assert sh.dtype == torch.float32
    assert sh.data is t
    assert sh.global_slice() == (slice(0, 3), slice(0, 5))


def test_from_rank_offsets_tp_and_dp_axes():
    t = torch.zeros(4, 6)
    sh = ShardedTensor.from_rank_offsets("w", t, (0, 2, 4), (1, 1, 3), replica_id=(0, 1))
    assert sh.global_shape == (16, 18)
    assert sh.global_offset == (8, 6)
    assert sh.axis_fragmentations == (4, 3)
    assert sh.global_slice() == (slice(8, 12), slice(6, 12))
    assert sh.max_allowed_chunks() == (4, 6)
    assert sh.local_chunk_offset_in_global() == (2, 1)
    assert sh.replica_id == (0, 1)


def test_from_rank_offsets_prepend_axes_for_stacked_layers():
    # Layer 3 of 8 stacked layers, TP rank 1 of 2 on the local axis 0.
    t = torch.zeros(5, 7)
    sh = ShardedTensor.from_rank_offsets("layers.w", t, (0, 3, 8), (1, 1, 2), prepend_axis_num=1)
    assert sh.local_shape == (5, 7)
    assert sh.global_shape == (8, 10, 7)
    assert sh.global_offset == (3, 5, 0)
    assert sh.axis_fragmentations == (8, 2, 1)
    assert sh.box_shape() == (1, 5, 7)
    assert sh.global_slice() == (3, slice(5, 10), slice(0, 7))
    assert sh.max_allowed_chunks() == (1, 5, 7)


def test_prepended_axis_without_rank_offset_has_size_one():
    sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2), prepend_axis_num=2)
    assert sh.global_shape == (1, 1, 2)
    assert sh.global_slice() == (0, 0, slice(0, 2))


@pytest.mark.parametrize(
    "rank_offsets, prepend, message",
    [
        ([(2, 0, 2)], 0, "axis 2 out of 2 axes"),
        ([(3, 0, 2)], 1, "axis 3 out of 3 axes"),
        ([(0, 0, 2), (0, 1, 2)], 0, "given twice"),
        ([(0, 2, 2)], 0, "rank offset 2 not below fragment count 2"),
        ([(0, 0, 0)], 0, "not below fragment count 0"),
        ([(0, -1, 2)], 0, "-1 is negative"),
    ],
)
def test_from_rank_offsets_rejects_bad_offsets(rank_offsets, prepend, message):
    # The core's geometry (tessera::ShardedTensor::from_rank_offsets) and its errors.
    with pytest.raises(CheckpointingException) as info:
        ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), *rank_offsets, prepend_axis_num=prepend)
    assert message in str(info.value)
    assert '"w"' in str(info.value)


def test_from_rank_offsets_rejects_a_malformed_entry():
    with pytest.raises(TypeError, match=r"\(axis, axis_rank_offset, axis_fragm\)"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 1))


def test_from_rank_offsets_refuses_flattened_range():
    with pytest.raises(CheckpointingException, match="from_rank_offsets_flat"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(4), flattened_range=slice(0, 2))


def test_from_rank_offsets_accepts_numpy_data():
    a = np.zeros((2, 3), dtype=np.int16)
    sh = ShardedTensor.from_rank_offsets("np", a, (0, 1, 2))
    assert sh.global_shape == (4, 3)
    assert sh.dtype == np.int16
    assert to_tessera_dtype(sh.dtype) == "i16"


# ---------------------------------------------------------------------------------------------
# Flattened ranges


def test_from_rank_offsets_flat_and_coordinates():
    full = torch.arange(12.0).reshape(3, 4)
    flat = full.flatten()[5:10]
    sh = ShardedTensor.from_rank_offsets_flat("w", flat, (3, 4), (1, 1, 2), flattened_range=slice(5, 10))
    assert sh.local_shape == (3, 4)
    assert sh.global_shape == (3, 8)
    assert sh.global_offset == (0, 4)
    assert sh.flattened_range == slice(5, 10)
    rows, cols = sh.local_coordinates()
    assert list(zip(rows.tolist(), cols.tolist())) == [(1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]
    grows, gcols = sh.global_coordinates()
    assert grows.tolist() == rows.tolist()
    assert gcols.tolist() == [c + 4 for c in cols.tolist()]
    # The coordinates index exactly the elements that data holds.
    assert torch.equal(full[rows, cols], flat)


def test_global_coordinates_with_prepended_axis():
    sh = ShardedTensor.from_rank_offsets_flat(
        "w", torch.zeros(3), (2, 2), (0, 5, 6), prepend_axis_num=1, flattened_range=slice(1, 4)
    )
    layer, rows, cols = sh.global_coordinates()
    assert layer.tolist() == [5, 5, 5]
    assert list(zip(rows.tolist(), cols.tolist())) == [(0, 1), (1, 0), (1, 1)]


def test_coordinates_need_a_flattened_range():
    sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2))
    with pytest.raises(CheckpointingException, match="flattened_range"):
        sh.local_coordinates()
    with pytest.raises(CheckpointingException, match="flattened_range"):
        sh.global_coordinates()


def test_from_rank_offsets_flat_validates_data_length():
    with pytest.raises(CheckpointingException, match="1-D with 3 elements"):
        ShardedTensor.from_rank_offsets_flat("w", torch.zeros(4), (2, 3), flattened_range=slice(0, 3))
    with pytest.raises(CheckpointingException, match="needs a flattened_range"):
        ShardedTensor.from_rank_offsets_flat("w", torch.zeros(4), (2, 3), flattened_range=None)


# ---------------------------------------------------------------------------------------------
# validate_metadata_integrity


def make(**overrides):
    fields = dict(
        key="k",
        data=None,
        dtype=torch.float32,
        local_shape=(2, 3),
        global_shape=(4, 3),
        global_offset=(2, 0),
        axis_fragmentations=(2, 1),
    )
    fields.update(overrides)
    return ShardedTensor(**fields)


def test_valid_metadata_without_data():
    sh = make(local_shape=[2, 3], global_shape=torch.Size([4, 3]))
    assert sh.local_shape == (2, 3) and sh.global_shape == (4, 3)


@pytest.mark.parametrize(
    "overrides, message",
    [
        # The core's checks (InvalidShardingError, InvalidArgumentError for negative numbers).
        (dict(global_offset=(0,)), "rank mismatch"),
        (dict(global_shape=(4, 3, 1), global_offset=(0, 0, 0)), "rank mismatch"),
        (dict(prepend_axis_num=1), "rank mismatch"),
        (dict(global_offset=(3, 0), axis_fragmentations=None), "exceeds global shape"),
        (dict(global_offset=(0, 1), axis_fragmentations=None), "exceeds global shape"),
        (dict(global_offset=(1, 0), global_shape=(6, 3)), "is not global 6 / 2 fragments"),
        (dict(axis_fragmentations=(2,)), "axis_fragmentations"),
        (dict(axis_fragmentations=(0, 1)), "0 fragments"),
        (dict(global_offset=(-2, 0)), "negative"),
        (dict(flattened_range=slice(0, 7)), "outside the 6 elements"),
        (dict(flattened_range=slice(4, 2)), "outside the 6 elements"),
        (dict(replica_id=-1), "replica_id"),
        # Python's: the slice, the data object and the dtype, which the core does not see.
        (dict(flattened_range=slice(0, 4, 2)), "step"),
        (dict(flattened_range=(0, 4)), "slice of ints"),
        (dict(data=torch.zeros(3, 2)), "data shape (3, 2) differs from local_shape (2, 3)"),
        (dict(data=torch.zeros(2, 3, dtype=torch.float16)), "data dtype torch.float16 differs"),
        (dict(data=torch.zeros(2, 3), flattened_range=slice(1, 4)), "1-D with 3 elements"),
        (dict(data=torch.zeros(4), flattened_range=slice(1, 4)), "1-D with 3 elements"),
        (dict(dtype=torch.complex64), "not supported"),
    ],
)
def test_invalid_metadata_is_rejected_clearly(overrides, message):
    with pytest.raises(CheckpointingException) as info:
        make(**overrides)
    assert message in str(info.value)
    assert '"k"' in str(info.value) or "'k'" in str(info.value)


@pytest.mark.parametrize(
    "overrides, message", [(dict(replica_id=(0, 1.5)), "replica_id"), (dict(key=3), "key must be a str")]
)
def test_fields_of_the_wrong_type_are_type_errors(overrides, message):
    with pytest.raises(TypeError, match=message):
        make(**overrides)


def test_uneven_shards_are_allowed_without_fragmentations():
    sh = make(local_shape=(3, 3), global_shape=(5, 3), global_offset=(2, 0), axis_fragmentations=None)
    assert sh.global_slice() == (slice(2, 5), slice(0, 3))
    with pytest.raises(CheckpointingException, match="no axis_fragmentations"):
        sh.max_allowed_chunks()


def test_allow_shape_mismatch_skips_bounds_only():
    sh = make(global_shape=(3, 3), axis_fragmentations=None, allow_shape_mismatch=True)
    assert sh.global_slice() == (slice(2, 4), slice(0, 3))
    # A grid the box does not cut evenly is refused all the same: the core's load refuses it.
    with pytest.raises(CheckpointingException, match="fragments"):
        make(global_shape=(3, 3), allow_shape_mismatch=True)
    strict = make(global_offset=(0, 0))
    strict.global_shape = (5, 3)
    with pytest.raises(CheckpointingException, match="not divisible into 2 fragments"):
        strict.max_allowed_chunks()


def test_validation_runs_again_when_called_after_mutation():
    sh = make()
    sh.global_offset = (4, 0)
    with pytest.raises(CheckpointingException, match="exceeds"):
        sh.validate_metadata_integrity()


# ---------------------------------------------------------------------------------------------
# Data helpers


def test_without_data_keeps_metadata():
    sh = ShardedTensor.from_rank_offsets("w", torch.ones(2, 2), (0, 1, 2), replica_id=1)
    bare = sh.without_data()
    assert bare.data is None and sh.data is not None
    assert (bare.key, bare.global_shape, bare.global_offset, bare.replica_id) == ("w", (4, 2), (2, 0), 1)


def test_init_data_allocates_local_or_flat_data():
    sh = make().without_data()
    sh.init_data("cpu")
    assert sh.data.shape == (2, 3) and sh.data.dtype == torch.float32
    existing = sh.data
    sh.init_data("cpu", init_fn=torch.ones)
    assert sh.data is existing, "init_data must not replace existing data"

    flat = make(flattened_range=slice(1, 5), dtype=torch.bfloat16)
    flat.init_data(torch.device("cpu"), init_fn=torch.ones)
    assert flat.data.shape == (4,) and flat.data.dtype == torch.bfloat16
    assert torch.all(flat.data == 1)
    flat.validate_metadata_integrity()


# ---------------------------------------------------------------------------------------------
# ShardedObject, LocalNonpersistentObject, replicas


def test_sharded_object_unique_key_roundtrip():
    obj = ShardedObject("rng/state", {"seed": 1}, (2, 4), (1, 3), replica_id=(0, 2))
    assert obj.unique_key == "rng/state/shard_1.3_2.4"
    empty = ShardedObject.empty_from_unique_key(obj.unique_key, replica_id=5)
    assert (empty.key, empty.data, empty.global_shape, empty.global_offset, empty.replica_id) == (
        "rng/state",
        None,
        (2, 4),
        (1, 3),
        5,
    )
    assert obj.without_data().data is None and obj.data == {"seed": 1}
    assert str(obj) == "ShardedObject(key='rng/state')"


def test_sharded_object_validation():
    with pytest.raises(CheckpointingException, match="different ranks"):
        ShardedObject("o", 1, (2,), (0, 0))
    # A shard outside its grid is the core's to refuse, with the other shards (save, validation).
    outside = ShardedObject("o", 1, (2,), (2,))
    with pytest.raises(CheckpointingException, match="outside grid"):
        validate_sharding_integrity([outside, ShardedObject("o", 1, (2,), (0,))])
    with pytest.raises(CheckpointingException, match="not a ShardedObject unique key"):
        ShardedObject.empty_from_unique_key("o/shards_0_1")
    scalar = ShardedObject("o", 1, (), ())
    assert scalar.unique_key == "o/shard__"
    assert ShardedObject.empty_from_unique_key(scalar.unique_key).global_shape == ()


def test_local_nonpersistent_object_and_alias():
    assert LocalNonpersitentObject is LocalNonpersistentObject
    marker = object()
    assert LocalNonpersistentObject(marker).unwrap() is marker


@pytest.mark.parametrize(
    "replica_id, main", [(0, True), (1, False), ((0, 0, 0), True), ((0, 1, 0), False), ((), True)]
)
def test_is_main_replica(replica_id, main):
    assert is_main_replica(replica_id) is main


# ---------------------------------------------------------------------------------------------
# Factories


def swiglu_factory(key, weight, tp_rank=0, tp_size=1, replica_id=0):
    """Megatron's SwiGLU pattern: the local weight is [w_tp ; v_tp] stacked, saved as two
    global tensors so that TP resharding keeps the halves apart."""

    def build(key, data, replica_id, flattened_range):
        w, v = torch.chunk(data, 2, dim=0)
        return {
            "w": ShardedTensor.from_rank_offsets(f"{key}_w", w, (0, tp_rank, tp_size), replica_id=replica_id),
            "v": ShardedTensor.from_rank_offsets(f"{key}_v", v, (0, tp_rank, tp_size), replica_id=replica_id),
        }

    def merge(sub_state):
        return torch.cat([sub_state["w"], sub_state["v"]])

    return ShardedTensorFactory(key, weight, build, merge, replica_id)


def test_apply_factories_and_merges_roundtrip():
    weight = torch.arange(8.0).reshape(4, 2)
    factory = swiglu_factory("fc1", weight, tp_rank=1, tp_size=2, replica_id=(0, 1))
    state = {"layer": {"fc1": factory, "bias": 3}, "list": [swiglu_factory("fc2", weight)]}
    apply_factories(state)
    built = state["layer"]["fc1"]
    assert set(built) == {"w", "v"}
    assert built["w"].key == "fc1_w" and built["w"].global_shape == (4, 2) and built["w"].global_offset == (2, 0)
    assert built["w"].replica_id == (0, 1)
    assert torch.equal(built["v"].data, weight[2:])
    assert state["layer"]["bias"] == 3
    assert isinstance(state["list"][0]["w"], ShardedTensor)

    # After loading, the factory positions hold the loaded sub-states; merges restore tensors.
    loaded = {
        "layer": {"fc1": {"w": weight[:2].clone(), "v": weight[2:].clone()}, "bias": 3},
        "list": [{"w": weight[:2], "v": weight[2:]}],
    }
    factories = {"layer": {"fc1": factory}, "list": [swiglu_factory("fc2", weight)]}
    merged = apply_factory_merges(loaded, factories)
    assert merged is loaded
    assert torch.equal(loaded["layer"]["fc1"], weight)
    assert torch.equal(loaded["list"][0], weight)
    assert loaded["layer"]["bias"] == 3


def test_apply_factory_merges_into_list_by_index_dict():
    weight = torch.ones(2, 1)
    loaded = [1, {"w": weight[:1], "v": weight[1:]}]
    apply_factory_merges(loaded, {1: swiglu_factory("f", weight)})
    assert torch.equal(loaded[1], weight)


@pytest.mark.parametrize(
    "x1, x2, message",
    [
        ({"a": 1}, {"b": None}, "missing from the loaded state dict"),
        ([1, 2], [None], "different length"),
        ([1], {3: None}, "invalid for a list of length 1"),
        ({"a": 1}, {"a": {"b": None}}, "cannot apply factory merges"),
    ],
)
def test_apply_factory_merges_errors(x1, x2, message):
    with pytest.raises(ValueError, match=message) as info:
        apply_factory_merges(x1, x2)
    assert isinstance(info.value, CheckpointingException)


def test_factory_validation_and_without_data():
    with pytest.raises(CheckpointingException, match="callable"):
        ShardedTensorFactory("f", torch.zeros(1), None, lambda x: x)
    factory = swiglu_factory("f", torch.zeros(2, 2))
    assert factory.without_data().data is None
    assert str(factory) == "ShardedTensorFactory(key='f')"


# ---------------------------------------------------------------------------------------------
# dtypes

ALL_TORCH_DTYPES = {
    "f64": torch.float64,
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f8_e4m3fn": torch.float8_e4m3fn,
    "f8_e5m2": torch.float8_e5m2,
    "i64": torch.int64,
    "i32": torch.int32,
    "i16": torch.int16,
    "i8": torch.int8,
    "u8": torch.uint8,
    "u16": torch.uint16,
    "u32": torch.uint32,
    "u64": torch.uint64,
    "bool": torch.bool,
}


def test_dtype_table_covers_every_tessera_type():
    assert set(ALL_TORCH_DTYPES) == set(TESSERA_DTYPES)


@pytest.mark.parametrize("name, dtype", sorted(ALL_TORCH_DTYPES.items()))
def test_torch_dtype_roundtrip(name, dtype):
    assert torch_dtype_to_tessera(dtype) == name
    assert tessera_dtype_to_torch(name) is dtype
    assert to_tessera_dtype(dtype) == name
    assert to_tessera_dtype(name) == name
    # A tensor of every type can be described by a ShardedTensor.
    sh = ShardedTensor.from_rank_offsets("t", torch.zeros(2, dtype=dtype))
    assert torch_dtype_to_tessera(sh.dtype) == name


@pytest.mark.parametrize(
    "dtype", [torch.complex64, torch.complex128, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.quint8, "f32"]
)
def test_unsupported_torch_dtypes_raise(dtype):
    with pytest.raises(CheckpointingException, match="not supported by tessera checkpoints"):
        torch_dtype_to_tessera(dtype)


def test_unknown_tessera_name_raises():
    with pytest.raises(CheckpointingException, match="unknown tessera element type 'f128'"):
        tessera_dtype_to_torch("f128")
    with pytest.raises(CheckpointingException, match="unknown tessera element type"):
        tessera_dtype_to_numpy("c64")


@pytest.mark.parametrize("name", [n for n in TESSERA_DTYPES if n not in ("bf16", "f8_e4m3fn", "f8_e5m2")])
def test_numpy_dtype_roundtrip(name):
    np_dtype = tessera_dtype_to_numpy(name)
    assert numpy_dtype_to_tessera(np_dtype) == name
    assert to_tessera_dtype(np_dtype) == name
    assert np.dtype(torch.zeros(1, dtype=tessera_dtype_to_torch(name)).numpy().dtype) == np_dtype


def test_numpy_without_counterpart_and_unsupported():
    with pytest.raises(CheckpointingException, match="no numpy dtype"):
        tessera_dtype_to_numpy("bf16")
    for bad in (np.complex64, np.dtype(">f4"), np.float128 if hasattr(np, "float128") else np.complex128):
        with pytest.raises(CheckpointingException, match="not supported"):
            numpy_dtype_to_tessera(bad)


# ---------------------------------------------------------------------------------------------
# torch stays optional


def test_package_imports_and_works_without_torch():
    script = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import numpy as np
from tessera import dist_checkpointing as dc
sh = dc.ShardedTensor.from_rank_offsets("w", np.zeros((2, 3), np.float32), (0, 1, 2), prepend_axis_num=0)
assert sh.global_shape == (4, 3)
assert dc.to_tessera_dtype(sh.dtype) == "f32"
left, right, mismatch = dc.diff({"a": np.ones(2)}, {"a": np.zeros(2)})
assert mismatch == [(("a",), np.ndarray, np.ndarray)]
assert dc.get_default_strategy(dc.StrategyAction.LOAD_SHARDED, "tessera", 1).backend == "tessera"
print("ok")
"""
    env = {"PYTHONPATH": str(PYTHON_DIR), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_factory_passes_flattened_range_to_build_fn():
    seen = []

    def build(key, data, replica_id, flattened_range):
        seen.append((key, replica_id, flattened_range))
        return ShardedTensor.from_rank_offsets(key, data, replica_id=replica_id)

    factory = ShardedTensorFactory("f", torch.zeros(4), build, lambda x: x, replica_id=1, flattened_range=slice(0, 2))
    built = factory.build()
    assert seen == [("f", 1, slice(0, 2))]
    assert isinstance(built, ShardedTensor) and built.key == "f"
    assert ShardedTensorFactory("g", torch.zeros(1), build, lambda x: x).flattened_range is None


def test_narrow_scales_the_global_box_on_a_regular_grid():
    data = torch.arange(12.0).reshape(4, 3)
    sh = ShardedTensor.from_rank_offsets("n", data, (0, 1, 2), (1, 0, 1), prepend_axis_num=1)
    assert sh.has_regular_grid
    assert sh.global_shape == (2, 4, 3) and sh.global_offset == (1, 0, 0)
    (out,) = sh.narrow(0, 1, 2)
    assert torch.equal(out.data, data[1:3])
    assert out.local_shape == (2, 3)
    assert out.global_shape == (2, 2, 3) and out.global_offset == (1, 0, 0)
    # A piece on the second of 2 rows: offset 4 of 8 becomes 2 of 4.
    sh2 = ShardedTensor.from_rank_offsets("n", data, (0, 1, 2))
    (out2,) = sh2.narrow(0, 0, 2)
    assert out2.global_shape == (4, 3) and out2.global_offset == (2, 0)


def test_narrow_refuses_an_irregular_grid():
    sh = ShardedTensor("n", torch.zeros(3, 2), torch.float32, (3, 2), (8, 2), (5, 0), None)
    assert not sh.has_regular_grid
    with pytest.raises(CheckpointingException, match="regular grid"):
        sh.narrow(0, 0, 1)
