"""dict_utils, utils, optimizer, core and strategies of tessera.dist_checkpointing."""

import copy
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.dist_checkpointing import (
    CheckpointingConfig,
    CheckpointingException,
    CheckpointingValueError,
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    check_is_distributed_checkpoint,
    maybe_load_config,
)
from tessera.dist_checkpointing import core as dc_core, dict_utils, optimizer, strategies, utils
from tessera.dist_checkpointing.strategies import StrategyAction


def sharded(key, shape=(2, 2), **kw):
    return ShardedTensor.from_rank_offsets(key, torch.zeros(shape), **kw)


# ---------------------------------------------------------------------------------------------
# dict_utils


def test_extract_matching_values_keeps_hierarchy():
    x = {"a": 1, "b": {"c": "m1", "d": 2, "e": []}, "l": [3, "m2", {"f": "m3"}, {}], "g": {"h": "m4"}}
    match, rest = dict_utils.extract_matching_values(x, lambda v: isinstance(v, str))
    assert match == {"b": {"c": "m1"}, "l": ["m2", {"f": "m3"}], "g": {"h": "m4"}}
    # Empty containers stay with the non-matching side, so the structure survives a round trip.
    assert rest == {"a": 1, "b": {"d": 2, "e": []}, "l": [3, {}]}


def test_extract_matching_values_lists_as_dicts_merge_back():
    x = {"l": [1, "m", [2, "n"]], "k": "o"}
    match, rest = dict_utils.extract_matching_values(x, lambda v: isinstance(v, str), return_lists_as_dicts=True)
    assert match == {"l": {1: "m", 2: {1: "n"}}, "k": "o"}
    assert rest == {"l": {0: 1, 2: {0: 2}}}
    _, rest_lists = dict_utils.extract_matching_values(x, lambda v: isinstance(v, str))
    assert rest_lists == {"l": [1, [2]]}
    # Index dicts merge into the positions of lists.
    assert dict_utils.merge([{"a": 1}, {"b": 2}], {1: {"c": 3}}) == [{"a": 1}, {"b": 2, "c": 3}]
    top_match, top_rest = dict_utils.extract_matching_values([1, "a"], lambda v: v == "a", return_lists_as_dicts=True)
    assert (top_match, top_rest) == ({1: "a"}, {0: 1})


def test_extract_matching_values_rejects_leaf_top_level():
    with pytest.raises(CheckpointingValueError, match="top-level"):
        dict_utils.extract_matching_values(5, bool)


def test_diff_dicts_lists_and_tensors():
    t = torch.arange(4)
    x1 = {"a": 1, "b": {"t": t, "u": torch.ones(2)}, "l": [1, 2, 3], "only1": 0, "n": np.ones(3)}
    x2 = {"a": 2, "b": {"t": t.clone(), "u": torch.zeros(2)}, "l": [1, 5], "only2": 0, "n": np.ones(3)}
    only_left, only_right, mismatch = dict_utils.diff(x1, x2)
    assert only_left == [("only1",), ("l", 2)]
    assert only_right == [("only2",)]
    assert mismatch == [(("a",), int, int), (("b", "u"), torch.Tensor, torch.Tensor), (("l", 1), int, int)]
    assert dict_utils.diff([1], [1, 2]) == ([], [(1,)], [])


@pytest.mark.parametrize(
    "left, right",
    [
        (torch.zeros(2), torch.zeros(3)),
        (torch.zeros(2), torch.zeros(2, dtype=torch.float64)),
        (torch.zeros(2), [0.0, 0.0]),
        ({"a": 1}, [1]),
        (np.zeros(2), np.ones(2)),
    ],
)
def test_diff_reports_mismatching_leaves(left, right):
    assert dict_utils.diff({"x": left}, {"x": right})[2] == [(("x",), type(left), type(right))]


def test_diff_equal_bf16_tensors():
    t = torch.randn(3, dtype=torch.bfloat16)
    assert dict_utils.diff({"t": t}, {"t": t.clone()}) == ([], [], [])


def test_inspect_types_prints_structure(capsys):
    dict_utils.inspect_types({"a": torch.zeros(2, 3), "b": [1, "x" * 40]})
    out = capsys.readouterr().out
    assert "> a: Tensor of shape (2, 3)" in out
    assert "- 0: [<class 'int'>]: 1" in out
    assert "... (truncated)" in out


def test_nested_values_and_items_iter():
    x = {"a": 1, "b": [2, {"c": 3}], "d": (4, 5)}
    assert list(dict_utils.nested_values(x)) == [1, 2, 3, (4, 5)]
    items = list(dict_utils.nested_items_iter(x))
    assert [(k, v) for _, k, v in items] == [("a", 1), (0, 2), ("c", 3), ("d", (4, 5))]
    container, key, _ = items[2]
    container[key] = 30
    assert x["b"][1]["c"] == 30


def test_dict_map_and_dict_map_with_key():
    x = {"a": 1, "b": [2, {"c": 3}]}
    dict_utils.dict_map(lambda v: v * 10, x)
    assert x == {"a": 10, "b": [20, {"c": 30}]}
    y = {"a": 1, "b": {"c": 2}, "l": [1]}
    dict_utils.dict_map_with_key(lambda k, v: f"{k}={v}", y)
    assert y == {"a": "a=1", "b": {"c": "c=2"}, "l": "l=[1]"}  # lists are leaves here


def test_dict_list_map_inplace_and_outplace():
    inner = [1, 2]
    x = {"a": inner, "b": {"c": 3}}
    out = dict_utils.dict_list_map_inplace(lambda v: v + 1, x)
    assert out is x and x["a"] is inner and x == {"a": [2, 3], "b": {"c": 4}}
    assert dict_utils.dict_list_map_inplace(str, 5) == "5"
    y = dict_utils.dict_list_map_outplace(lambda v: -v, x)
    assert y == {"a": [-2, -3], "b": {"c": -4}}
    assert y["a"] is not inner and x == {"a": [2, 3], "b": {"c": 4}}


def test_merge_dicts_and_lists():
    x1 = {"a": {"b": 1}, "l": [{"x": 1}, 2]}
    x2 = {"a": {"c": 2}, "l": [{"y": 3}, {}], "d": 4}
    # A leaf meeting an (empty) dict is a conflict, like any two leaves.
    with pytest.raises(CheckpointingValueError, match="duplicate non-dict"):
        dict_utils.merge(copy.deepcopy(x1), x2)
    x2["l"][1] = {}
    x1["l"][1] = {"z": 2}
    merged = dict_utils.merge(x1, x2)
    assert merged is x1
    assert x1 == {"a": {"b": 1, "c": 2}, "l": [{"x": 1, "y": 3}, {"z": 2}], "d": 4}


@pytest.mark.parametrize(
    "x1, x2, message",
    [
        ([1], [1, 2], "different lengths"),
        ({"a": 1}, {"a": 2}, "duplicate non-dict"),
        ([1], {"k": 1}, "non-integer key"),
        ([{}], {4: {}}, "out of bounds"),
    ],
)
def test_merge_errors_are_value_errors(x1, x2, message):
    with pytest.raises(ValueError, match=message) as info:
        dict_utils.merge(x1, x2)
    assert isinstance(info.value, CheckpointingException)


def test_map_reduce():
    words = ["apple", "avocado", "banana", "blueberry", "cherry"]
    assert dict_utils.map_reduce(words, key_fn=lambda w: w[0], value_fn=len, reduce_fn=sum) == {
        "a": 12,
        "b": 15,
        "c": 6,
    }
    assert dict_utils.map_reduce([1, 1, 2]) == {1: [1, 1], 2: [2]}


# ---------------------------------------------------------------------------------------------
# utils


def mixed_state():
    factory = ShardedTensorFactory("f", torch.zeros(2), lambda k, d, r, f: {}, lambda s: s)
    return {
        "t": sharded("t"),
        "o": ShardedObject("o", 1, (1,), (0,)),
        "f": factory,
        "n": LocalNonpersistentObject(7),
        "plain": 3,
        "nested": [sharded("u"), "s"],
    }


@pytest.mark.parametrize(
    "extract, matching_keys",
    [
        (utils.extract_sharded_tensors, {"t", "nested"}),
        (utils.extract_sharded_tensors_and_factories, {"t", "f", "nested"}),
        (utils.extract_sharded_tensors_or_nonpersistent, {"t", "f", "n", "nested"}),
        (utils.extract_sharded_base, {"t", "o", "f", "nested"}),
        (utils.extract_nonpersistent, {"n"}),
    ],
)
def test_extractors(extract, matching_keys):
    state = mixed_state()
    match, rest = extract(state)
    assert set(match) == matching_keys
    assert set(rest) == (set(state) - matching_keys) | {"nested"}
    assert rest["nested"][-1] == "s"
    assert len(rest["nested"]) == (1 if "nested" in match else 2)
    for key in matching_keys:
        assert key == "nested" or match[key] is state[key]


def test_add_prefix_for_sharding():
    state = mixed_state()
    utils.add_prefix_for_sharding(state, "model.")
    assert [state[k].key for k in ("t", "o", "f")] == ["model.t", "model.o", "model.f"]
    assert state["nested"][0].key == "model.u"
    assert state["n"].unwrap() == 7 and state["plain"] == 3


def test_replace_prefix_for_sharding():
    state = {"a": sharded("dec.a"), "b": [ShardedObject("dec.b", 0, (1,), (0,))]}
    utils.replace_prefix_for_sharding(state, "dec.", "decoder.")
    assert (state["a"].key, state["b"][0].key) == ("decoder.a", "decoder.b")


def test_replace_prefix_for_sharding_requires_prefix_everywhere():
    state = {"a": sharded("dec.a"), "b": sharded("enc.b")}
    with pytest.raises(ValueError, match="'enc.b' to begin with prefix 'dec.'") as info:
        utils.replace_prefix_for_sharding(state, "dec.", "decoder.")
    assert isinstance(info.value, CheckpointingException)
    assert state["a"].key == "dec.a", "a failed replacement must not leave keys half renamed"


def test_apply_prefix_mapping_uses_first_match():
    state = {"a": sharded("enc.layer.a"), "b": sharded("dec.b"), "c": sharded("other.c")}
    utils.apply_prefix_mapping(state, {"enc.layer.": "E.", "enc.": "X.", "dec.": "D."})
    assert [state[k].key for k in "abc"] == ["E.a", "D.b", "other.c"]


# ---------------------------------------------------------------------------------------------
# optimizer


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def train_step(model, optim):
    optim.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    optim.step()


def tp_rank1_sharded_model(model):
    """The model's parameters as TP rank 1 of 2 would describe them (weights split on axis 0,
    biases replicated with replica id 1)."""
    out = {}
    for name, param in model.state_dict(keep_vars=True).items():
        if name.endswith("weight"):
            out[name] = ShardedTensor.from_rank_offsets(name, param, (0, 1, 2))
        else:
            out[name] = ShardedTensor.from_rank_offsets(name, param, replica_id=1)
    return out


def test_get_optim_param_to_id_map_first_occurrence_wins():
    a, b = torch.zeros(1), torch.zeros(1)
    assert optimizer.get_optim_param_to_id_map([a, b, a]) == {id(a): 0, id(b): 1}


def test_param_id_map_matches_by_identity():
    model = tiny_model()
    sharded_model = tp_rank1_sharded_model(model)
    sharded_model["extra"] = sharded("not_a_param")
    id_map = optimizer.get_param_id_to_sharded_param_map({"model": sharded_model}, model.parameters())
    assert {i: sh.key for i, sh in id_map.items()} == {0: "0.weight", 1: "0.bias", 2: "2.weight", 3: "2.bias"}


def test_param_id_map_warns_when_nothing_matches(caplog):
    model = tiny_model()
    detached = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in model.state_dict().items()}
    with caplog.at_level("WARNING"):
        assert optimizer.get_param_id_to_sharded_param_map(detached, model.parameters()) == {}
    assert "keep_vars=True" in caplog.text


def test_optim_state_to_sharding_state_with_adamw():
    model = tiny_model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    train_step(model, optim)
    id_map = optimizer.get_param_id_to_sharded_param_map(tp_rank1_sharded_model(model), model.parameters())
    state = optim.state_dict()
    original_groups = copy.deepcopy(state["param_groups"])
    raw = {pid: dict(s) for pid, s in state["state"].items()}
    optimizer.optim_state_to_sharding_state(state, id_map)

    exp_avg = state["state"][0]["exp_avg"]
    assert isinstance(exp_avg, ShardedTensor)
    assert exp_avg.key == "optimizer.state.exp_avg.0.weight"
    assert exp_avg.data is raw[0]["exp_avg"]
    assert (exp_avg.global_shape, exp_avg.global_offset, exp_avg.axis_fragmentations) == ((12, 4), (6, 0), (2, 1))
    assert state["state"][3]["exp_avg_sq"].key == "optimizer.state.exp_avg_sq.2.bias"
    assert state["state"][3]["exp_avg_sq"].replica_id == 1

    # AdamW's scalar step: one replicated 0-dim tensor per param, saved by the first chunk's
    # main replica only (here: nobody on TP rank 1, whose weights start at row 6 and whose
    # biases are replicas).
    step = state["state"][0]["step"]
    assert (step.key, step.local_shape, step.global_shape) == ("optimizer.state.step.0.weight", (), ())
    assert step.data is raw[0]["step"] and float(step.data) == 1.0
    assert [state["state"][i]["step"].replica_id for i in range(4)] == [1, 1, 1, 1]

    for group, original in zip(state["param_groups"], original_groups):
        assert isinstance(group["params"], LocalNonpersistentObject)
        assert group["params"].unwrap() == original["params"]
        assert {k: v for k, v in group.items() if k != "params"} == {
            k: v for k, v in original.items() if k != "params"
        }
    assert isinstance(optim.state_dict()["param_groups"][0]["params"], list), "the optimizer must be untouched"


def test_sharded_optimizer_state_loads_back_into_torch():
    """What a load returns (sharded leaves replaced by tensors, non-persistent values
    unwrapped) is a torch.optim state dict that continues training identically."""
    model = tiny_model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, optim)
    reference_model = copy.deepcopy(model)
    reference_optim = torch.optim.AdamW(reference_model.parameters(), lr=0.1)
    reference_optim.load_state_dict(optim.state_dict())

    state = optim.state_dict()
    id_map = optimizer.get_param_id_to_sharded_param_map(
        {k: ShardedTensor.from_rank_offsets(k, v) for k, v in model.state_dict(keep_vars=True).items()},
        model.parameters(),
    )
    optimizer.optim_state_to_sharding_state(state, id_map)
    assert [state["state"][i]["step"].replica_id for i in range(4)] == [0, 0, 0, 0]

    def as_loaded(x):
        if isinstance(x, ShardedTensor):
            return x.data.clone()
        if isinstance(x, LocalNonpersistentObject):
            return x.unwrap()
        return x

    loaded = dict_utils.dict_list_map_outplace(as_loaded, state)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    fresh.load_state_dict(loaded)
    torch.manual_seed(1)
    train_step(model, fresh)
    torch.manual_seed(1)
    train_step(reference_model, reference_optim)
    for p, q in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(p, q)


def test_optim_state_exclude_keys_and_unknown_param():
    model = tiny_model()
    optim = torch.optim.AdamW(model.parameters())
    train_step(model, optim)
    id_map = optimizer.get_param_id_to_sharded_param_map(tp_rank1_sharded_model(model), model.parameters())
    state = optim.state_dict()
    optimizer.optim_state_to_sharding_state(state, id_map, exclude_keys=("step", "exp_avg_sq"))
    assert all(set(s) == {"exp_avg"} for s in state["state"].values())

    partial = {i: sh for i, sh in id_map.items() if i != 2}
    with pytest.raises(CheckpointingValueError, match="param id 2"):
        optimizer.optim_state_to_sharding_state(optim.state_dict(), partial)


def test_make_sharded_optimizer_tensor_variants():
    param = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (1, 1, 2), replica_id=(0, 1))
    moment = torch.ones(2, 3, dtype=torch.float64)
    sh = optimizer.make_sharded_optimizer_tensor(param, moment, "optimizer.state.exp_avg")
    assert (sh.key, sh.dtype, sh.global_offset, sh.replica_id) == (
        "optimizer.state.exp_avg.w",
        torch.float64,
        (0, 3),
        (0, 1),
    )
    assert param.key == "w" and param.dtype == torch.float32, "the model param is not modified"
    with pytest.raises(CheckpointingException, match=r"shape \(3, 2\) does not match"):
        optimizer.make_sharded_optimizer_tensor(param, torch.ones(3, 2), "p")

    flat_param = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(4), (2, 3), flattened_range=slice(1, 5))
    flat = optimizer.make_sharded_optimizer_tensor(flat_param, torch.ones(4), "p")
    assert flat.flattened_range == slice(1, 5) and flat.key == "p.w"
    with pytest.raises(CheckpointingException, match="flattened range"):
        optimizer.make_sharded_optimizer_tensor(flat_param, torch.ones(5), "p")

    factory = ShardedTensorFactory("f", torch.zeros(2), lambda k, d, r, f: {}, lambda s: s, replica_id=2)
    built = optimizer.make_sharded_optimizer_tensor(factory, moment, "p")
    assert isinstance(built, ShardedTensorFactory)
    assert (built.key, built.data, built.replica_id) == ("p.f", moment, 2)


def test_factory_param_with_scalar_state_asks_for_exclusion():
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    optim = torch.optim.AdamW([weight])
    weight.grad = torch.ones(2, 2)
    optim.step()
    factory = ShardedTensorFactory("f", weight, lambda k, d, r, f: {}, lambda s: s)
    with pytest.raises(CheckpointingException, match=r"exclude_keys=\('step',\)"):
        optimizer.optim_state_to_sharding_state(optim.state_dict(), {0: factory})
    state = optim.state_dict()
    optimizer.optim_state_to_sharding_state(state, {0: factory}, exclude_keys=("step",))
    assert state["state"][0]["exp_avg"].key == "optimizer.state.exp_avg.f"


# ---------------------------------------------------------------------------------------------
# core


def test_checkpointing_exception_is_the_package_base():
    try:
        from tessera.errors import TesseraError
    except ImportError:
        assert issubclass(CheckpointingException, Exception)
    else:
        assert CheckpointingException is TesseraError
    assert issubclass(CheckpointingValueError, CheckpointingException)
    assert issubclass(CheckpointingValueError, ValueError)


def test_checkpointing_config_defaults():
    config = CheckpointingConfig("tessera")
    assert (config.sharded_backend_version, config.common_backend, config.common_backend_version) == (
        1,
        "tessera",
        1,
    )


@pytest.fixture
def fake_native(monkeypatch):
    """Replaces the native extension that ``dist_checkpointing.core`` reads checkpoints with by
    a stub whose detect() answers from a dict (and whose checkpoints have no files to read)."""
    answers = {}

    def detect(location):
        if location == "/missing":
            raise FileNotFoundError(location)
        return answers.get(location)

    def read_file(location, name):
        return None  # the stub's checkpoints hold no metadata.json

    from tessera import _native

    module = types.SimpleNamespace(detect=detect, read_file=read_file, Location=_native.Location)
    monkeypatch.setattr(dc_core, "_native", module)
    return answers


def test_maybe_load_config_from_detect(fake_native):
    def fmt(backend, version, **kind):
        flags = {"is_native": False, "is_dcp": False, "is_megatron": False, **kind}
        return types.SimpleNamespace(backend=backend, version=version, **flags)

    fake_native["/ckpt"] = fmt("tessera", 1, is_native=True)
    fake_native["/zarr"] = fmt("zarr", 1, is_megatron=True)
    assert maybe_load_config("/ckpt") == CheckpointingConfig("tessera", 1, "tessera", 1)
    assert maybe_load_config("/zarr") == CheckpointingConfig("zarr", 1, "torch", 1)
    # A torch_dist checkpoint whose metadata.json is not readable here keeps Megatron's torch
    # common state; a plain DCP one names its own backend for both.
    fake_native["/dist"] = fmt("torch_dist", 1, is_dcp=True, is_megatron=True)
    fake_native["/dcp"] = fmt("torch_dcp", 1, is_dcp=True)
    assert maybe_load_config("/dist") == CheckpointingConfig("torch_dist", 1, "torch", 1)
    assert maybe_load_config("/dcp") == CheckpointingConfig("torch_dcp", 1, "torch_dcp", 1)
    assert maybe_load_config("/empty") is None
    assert maybe_load_config("/missing") is None
    assert check_is_distributed_checkpoint("/ckpt") is True
    assert check_is_distributed_checkpoint("/empty") is False


def test_check_is_distributed_checkpoint_with_real_native(tmp_path):
    pytest.importorskip("tessera._native")
    from tessera.dist_checkpointing import serialization

    assert not check_is_distributed_checkpoint(tmp_path)
    serialization.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, str(tmp_path / "ckpt"))
    version = strategies.TESSERA_BACKEND_VERSION
    assert maybe_load_config(tmp_path / "ckpt") == CheckpointingConfig("tessera", version, "tessera", version)


def test_the_python_format_version_is_the_native_one():
    native = pytest.importorskip("tessera._native")
    assert strategies.TESSERA_BACKEND_VERSION == native.FORMAT_VERSION
    assert native.FORMAT_VERSION in strategies.TESSERA_READ_VERSIONS


def test_a_version_1_checkpoint_loads_through_the_default_strategies():
    # The golden checkpoint written by tessera 0.1 in format version 1.
    pytest.importorskip("tessera._native")
    from tessera.dist_checkpointing import serialization

    golden = Path(__file__).resolve().parents[2] / "crates/tessera/tests/fixtures/golden_v1"
    config = maybe_load_config(golden)
    assert config == CheckpointingConfig("tessera", 1, "tessera", 1)
    strategy = strategies.get_default_strategy(
        StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version
    )
    strategy.check_version_compatibility(config.sharded_backend_version)
    loaded = serialization.load(
        {"norm": ShardedTensor.from_rank_offsets("final_norm", torch.zeros(3, dtype=torch.float16))},
        str(golden),
        sharded_strategy=strategy,
    )
    assert loaded["norm"].tolist() == [1.0, -2.0, 0.5]


# ---------------------------------------------------------------------------------------------
# strategies


def test_strategy_actions():
    assert [a.value for a in StrategyAction] == ["load_common", "load_sharded", "save_common", "save_sharded"]


def test_default_tessera_strategies():
    save = strategies.get_default_strategy(StrategyAction.SAVE_SHARDED, "tessera", 2)
    load = strategies.get_default_strategy(StrategyAction.LOAD_SHARDED, "tessera", 2)
    common = strategies.get_default_strategy(StrategyAction.LOAD_COMMON, "tessera", 2)
    assert isinstance(save, strategies.TesseraSaveShardedStrategy)
    assert isinstance(load, strategies.TesseraLoadShardedStrategy)
    assert isinstance(common, strategies.TesseraLoadCommonStrategy)
    assert (save.backend, save.version, load.backend, load.version) == ("tessera", 2, "tessera", 2)
    assert save.can_handle_sharded_objects and load.can_handle_sharded_objects
    assert str(save) == "TesseraSaveShardedStrategy(tessera, 2)"
    load.check_backend_compatibility("tessera")
    # Version 1 checkpoints are read by the same strategies; tessera writes only version 2.
    load.check_version_compatibility(1)
    load.check_version_compatibility(2)
    assert isinstance(strategies.get_default_strategy(StrategyAction.LOAD_SHARDED, "tessera", 1), type(load))
    assert isinstance(strategies.get_default_strategy(StrategyAction.LOAD_COMMON, "tessera", 1), type(common))
    with pytest.raises(CheckpointingException, match="no default save_sharded strategy for backend 'tessera' version 1"):
        strategies.get_default_strategy(StrategyAction.SAVE_SHARDED, "tessera", 1)
    with pytest.raises(CheckpointingException, match="version 1 is not supported"):
        strategies.TesseraSaveShardedStrategy("tessera", 1)
    with pytest.raises(CheckpointingException, match="not 'zarr'"):
        load.check_backend_compatibility("zarr")
    with pytest.raises(CheckpointingException, match="version 3 is not supported"):
        common.check_version_compatibility(3)
    with pytest.raises(CheckpointingException, match="not 'torch'"):
        strategies.TesseraSaveShardedStrategy("torch", 2)


def test_unknown_default_strategy_raises():
    with pytest.raises(CheckpointingException, match="no default save_sharded strategy for backend 'zarr' version 1"):
        strategies.get_default_strategy(StrategyAction.SAVE_SHARDED, "zarr", 1)
    with pytest.raises(CheckpointingException, match="version 7"):
        strategies.get_default_strategy(StrategyAction.LOAD_SHARDED, "tessera", 7)


def test_register_megatron_style_strategy(monkeypatch):
    monkeypatch.setattr(strategies, "_default_strategies", copy.copy(strategies._default_strategies))

    class RecordingSave(strategies.SaveShardedStrategy):
        def __init__(self):
            super().__init__("recording", 3)
            self.saved = []

        def save(self, sharded_state_dict, checkpoint_dir):
            self.saved.append((sharded_state_dict, checkpoint_dir))

    strategy = RecordingSave()
    strategies.register_default_strategy(StrategyAction.SAVE_SHARDED, "recording", 3, strategy)
    assert strategies.get_default_strategy(StrategyAction.SAVE_SHARDED, "recording", 3) is strategy
    assert not strategy.can_handle_sharded_objects
    strategy.save({}, "/d")
    assert strategy.saved == [({}, "/d")]
    with pytest.raises(NotImplementedError):
        strategies.SaveCommonStrategy.save_sharded_objects(strategy, {}, "/d")


def test_strategy_bases_are_abstract():
    for base in (
        strategies.SaveShardedStrategy,
        strategies.SaveCommonStrategy,
        strategies.LoadShardedStrategy,
        strategies.LoadCommonStrategy,
    ):
        with pytest.raises(TypeError):
            base("x", 1) if issubclass(base, strategies.SaveStrategyBase) else base()


def test_load_strategy_metadata_defaults():
    class TensorsOnly(strategies.LoadShardedStrategy):
        def check_backend_compatibility(self, loaded_backend):
            pass

        def check_version_compatibility(self, loaded_version):
            pass

        def load(self, sharded_state_dict, checkpoint_dir):
            return {}

        def load_tensors_metadata(self, checkpoint_dir):
            return {"t": checkpoint_dir}

    strategy = TensorsOnly()
    assert strategy.load_sharded_metadata("/d") == {"t": "/d"}
    with pytest.raises(NotImplementedError):
        strategy.remove_sharded_tensors("/d", "t")


def test_tessera_strategies_run_the_native_engine(tmp_path):
    pytest.importorskip("tessera._native")
    location = str(tmp_path / "ckpt")
    save = strategies.get_default_strategy(StrategyAction.SAVE_SHARDED, "tessera", 2)
    load = strategies.get_default_strategy(StrategyAction.LOAD_SHARDED, "tessera", 2)
    common = strategies.get_default_strategy(StrategyAction.LOAD_COMMON, "tessera", 2)
    weight = torch.arange(6.0).reshape(2, 3)
    save.save(
        {"w": ShardedTensor.from_rank_offsets("w", weight), "b": ShardedTensor.from_rank_offsets("b", torch.ones(2))},
        location,
    )
    metadata = load.load_tensors_metadata(location)
    assert {k: (v.global_shape, v.dtype) for k, v in metadata.items()} == {
        "w": ((2, 3), torch.float32),
        "b": ((2,), torch.float32),
    }
    loaded = load.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}, location)
    assert torch.equal(loaded["w"], weight)
    assert common.load_common(location) == {}
    assert load.remove_sharded_tensors(location, "b") == ["b"]
    assert set(load.load_sharded_metadata(location)) == {"w"}


def sharded_optim_state(model, optim):
    id_map = optimizer.get_param_id_to_sharded_param_map(
        {k: ShardedTensor.from_rank_offsets(k, v) for k, v in model.state_dict(keep_vars=True).items()},
        model.parameters(),
    )
    state = optim.state_dict()
    optimizer.optim_state_to_sharding_state(state, id_map)
    return state


def save_and_load_adamw(tmp_path):
    """Saves AdamW state after two steps and loads it for a fresh optimizer; returns
    (original optimizer, fresh optimizer, loaded state dict)."""
    from tessera.dist_checkpointing import serialization

    model = tiny_model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, optim)
    train_step(model, optim)
    serialization.save({"optimizer": sharded_optim_state(model, optim)}, str(tmp_path / "ckpt"))
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, fresh)  # populate state so that the sharded state dict has every key
    loaded = serialization.load({"optimizer": sharded_optim_state(model, fresh)}, str(tmp_path / "ckpt"))
    return optim, fresh, loaded


def test_adamw_state_roundtrip_through_a_checkpoint(tmp_path):
    """The sharded optimizer state, scalar step included, saves and loads with the native engine."""
    pytest.importorskip("tessera._native")
    optim, _, loaded = save_and_load_adamw(tmp_path)
    for pid, expected in optim.state_dict()["state"].items():
        got = loaded["optimizer"]["state"][pid]
        assert got["step"].shape == () and float(got["step"]) == 2.0
        assert torch.equal(got["exp_avg"], expected["exp_avg"])
        assert torch.equal(got["exp_avg_sq"], expected["exp_avg_sq"])
    assert loaded["optimizer"]["param_groups"][0]["params"] == [0, 1, 2, 3]


def test_loaded_adamw_state_is_accepted_by_torch(tmp_path):
    pytest.importorskip("tessera._native")
    optim, fresh, loaded = save_and_load_adamw(tmp_path)
    assert isinstance(loaded["optimizer"]["state"], dict)
    fresh.load_state_dict(loaded["optimizer"])
    assert float(fresh.state_dict()["state"][0]["step"]) == 2.0
