"""tessera.dist_checkpointing mirrors megatron.core.dist_checkpointing module for module, and
strategies are pluggable as in Megatron (a caller's own strategy object is the one called)."""

import importlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tessera._native")

from tessera._core.values import torch_load_bytes
from tessera import dist_checkpointing as dc  # noqa: E402
from tessera.dist_checkpointing import ShardedTensor, _engine, serialization  # noqa: E402
from tessera.dist_checkpointing.core import CheckpointingException  # noqa: E402
from tessera.dist_checkpointing.strategies.base import SaveShardedStrategy, LoadShardedStrategy  # noqa: E402

MEGATRON_MODULES = [
    "core", "dict_utils", "exchange_utils", "mapping", "optimizer", "serialization", "state_dict_utils",
    "tensor_aware_state_dict", "utils", "validation",
    "strategies.async_utils", "strategies.base", "strategies.cached_metadata_filesystem_reader",
    "strategies.checkpointable", "strategies.common", "strategies.filesystem_async", "strategies.fully_parallel",
    "strategies.state_dict_saver", "strategies.torch", "strategies.zarr", "strategies.tensorstore", "strategies.two_stage",
]


@pytest.mark.parametrize("name", MEGATRON_MODULES)
def test_every_megatron_module_exists(name):
    importlib.import_module(f"tessera.dist_checkpointing.{name}")


def test_names_megatron_core_and_training_import():
    from tessera.dist_checkpointing.optimizer import KEEP_VARS_HINT
    from tessera.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
        load_sharded_metadata,
    )
    from tessera.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync, _results_queue
    from tessera.dist_checkpointing.strategies.fully_parallel import _sharded_tensor_shard_id
    from tessera.dist_checkpointing.exchange_utils import distribute_shards_to_ranks
    from tessera.dist_checkpointing.core import save_config

    assert "keep_vars=True" in KEEP_VARS_HINT
    assert callable(FileSystemWriterAsync.write_preloaded_data) and _results_queue is None
    # Megatron's signature and default; save() without a strategy still writes tessera's format.
    assert get_default_save_sharded_strategy().backend == "torch_dist"
    assert get_default_save_sharded_strategy("tessera").backend == "tessera"
    assert callable(get_default_load_sharded_strategy) and callable(load_sharded_metadata)
    assert callable(save_config) and callable(_sharded_tensor_shard_id)
    # Greedy: lowest coverage first, then largest; ties to the least loaded, lowest rank.
    assert distribute_shards_to_ranks({"a": [0, 1], "b": [1], "c": [0, 1]}, {"a": 4, "b": 8, "c": 2}, 2, set()) == {
        "b": 1, "a": 0, "c": 0,
    }


def test_save_writes_tessera_format_unless_the_default_getter_is_replaced(tmp_path, monkeypatch):
    sd = lambda: {"w": ShardedTensor.from_rank_offsets("w", torch.arange(3.0))}  # noqa: E731
    dc.save(sd(), str(tmp_path / "native"))
    assert dc.core.maybe_load_config(str(tmp_path / "native")).sharded_backend == "tessera"
    # Megatron's tests (and users) pick the default by replacing the module's getter.
    pick = lambda: serialization.get_default_strategy(serialization.StrategyAction.SAVE_SHARDED, "torch_dist", 1)  # noqa: E731
    monkeypatch.setattr(serialization, "get_default_save_sharded_strategy", pick)
    dc.save(sd(), str(tmp_path / "dist"))
    assert (tmp_path / "dist" / ".metadata").is_file()
    assert dc.load(sd(), str(tmp_path / "dist"))["w"].tolist() == [0.0, 1.0, 2.0]


class RecordingSave(SaveShardedStrategy):
    def __init__(self):
        super().__init__("recording", 1)
        self.saved = []

    def save(self, sharded_state_dict, checkpoint_dir):
        self.saved.append(sorted(sh.key for sh in dc.dict_utils.nested_values(sharded_state_dict)))


class RecordingLoad(LoadShardedStrategy):
    def __init__(self):
        self.loaded = []

    def load(self, sharded_state_dict, checkpoint_dir):
        self.loaded.append(sorted(sharded_state_dict))
        return {k: torch.full(tuple(sh.local_shape), 7.0) for k, sh in sharded_state_dict.items()}

    def load_tensors_metadata(self, checkpoint_dir):
        return {}

    def load_sharded_metadata(self, checkpoint_dir):
        return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3)), "v": ShardedTensor.from_rank_offsets("v", torch.zeros(1))}

    def check_backend_compatibility(self, loaded_backend):
        assert loaded_backend == "recording"

    def check_version_compatibility(self, loaded_version):
        assert loaded_version == 1


def test_a_callers_strategy_is_called(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_strategy = RecordingSave()
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(3)), "step": 5}
    assert dc.save(sd, str(ckpt), save_strategy) is None
    assert save_strategy.saved == [["w"]]
    # The checkpoint describes itself as Megatron's do (metadata.json), common state in common.pt.
    assert dc.maybe_load_config(ckpt).sharded_backend == "recording"
    load_strategy = RecordingLoad()
    out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3))}, str(ckpt), load_strategy)
    assert load_strategy.loaded == [["w"]]
    assert out["step"] == 5 and out["w"].tolist() == [7.0, 7.0, 7.0]


def test_strictness_with_a_callers_strategy(tmp_path, caplog):
    # The keys are compared with what the strategy's load_sharded_metadata lists, as Megatron does.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(3))}, str(ckpt), RecordingSave())

    def request():
        return {
            "w": ShardedTensor.from_rank_offsets("w", torch.zeros(3)),
            "x": ShardedTensor.from_rank_offsets("x", torch.zeros(2)),
        }

    with pytest.raises(dc.CheckpointingException, match="Unexpected keys.*'x'"):
        dc.load(request(), str(ckpt), RecordingLoad(), strict=dc.StrictHandling.RAISE_UNEXPECTED)
    load_strategy = RecordingLoad()
    out, missing, unexpected = dc.load(request(), str(ckpt), load_strategy, strict=dc.StrictHandling.RETURN_ALL)
    assert (missing, unexpected) == ({"v"}, {"x"})
    assert load_strategy.loaded == [["w"]], "the unexpected key is not asked of the strategy"
    with caplog.at_level("WARNING"):
        dc.load(request(), str(ckpt), RecordingLoad(), strict=dc.StrictHandling.LOG_ALL)
    assert "Missing keys" in caplog.text and "Unexpected keys" in caplog.text


def test_wrapped_callers_strategy_is_called(tmp_path):
    strategy = RecordingSave()
    wrapper = dc.FullyParallelSaveStrategyWrapper(strategy)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, str(ckpt), wrapper)
    assert strategy.saved == [["w"]]


def test_preprocess_common_and_content_metadata(tmp_path):
    seen = []

    def preprocess(common):
        seen.append(dict(common))
        return {k: v for k, v in common.items() if k != "rank_local"}

    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "rank_local": 1}
    dc.save(sd, str(tmp_path / "c"), preprocess_common_before_consistancy_check=preprocess, content_metadata={"v": 3})
    assert seen and seen[0]["rank_local"] == 1
    assert dc.load_content_metadata(str(tmp_path / "c")) == {"v": 3}
    loaded = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, str(tmp_path / "c"))
    assert dc.load_content_metadata(preloaded_state_dict=loaded) == {"v": 3}
    with pytest.raises(ValueError):
        dc.load_content_metadata()


def test_missing_directory_message(tmp_path):
    missing = tmp_path / "nope" / "ckpt"
    with pytest.raises(CheckpointingException, match=f"directory {missing} does not exist"):
        dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointingException, match="is not a distributed checkpoint"):
        dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, str(tmp_path / "empty"))


def test_torch_dist_save_goes_through_one_place(tmp_path, monkeypatch):
    calls = []
    plan = serialization._native.plan_torch_dist
    monkeypatch.setattr(serialization._native, "plan_torch_dist", lambda *a, **k: calls.append(a) or plan(*a, **k))
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "x": 1}, str(tmp_path / "t"), ("torch_dist", 1))
    (tensors, objects, common_pt, location, owners, comm) = calls[0]
    assert [t.key for t in tensors] == ["w"] and objects == [] and location.endswith("t")
    assert torch_load_bytes(common_pt) == {"x": 1}
    assert (tmp_path / "t" / ".metadata").is_file()


def test_tensor_aware_state_dict_round_trip():
    from tessera.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "step": 3}
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(sd, algo="atomic")
    tensors = tasd.pop_tensors()
    assert tasd.is_hollow and [t.tolist() for t in tensors] == [[0.0, 1.0, 2.0, 3.0]]
    tasd.insert_tensors([t * 2 for t in tensors])
    out = tasd.to_state_dict({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, validate_access_integrity=False)
    assert out["step"] == 3 and out["w"].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_checkpointable_sharded_tensors_go_through_plain_dcp(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from tessera.dist_checkpointing import ShardedTensor
    from tessera.dist_checkpointing.strategies.checkpointable import (
        CheckpointableShardedTensor,
        LocalShardsContainer,
    )

    def state(val):
        one = ShardedTensor.from_rank_offsets("t", torch.full((3,), val), (0, 0, 2))
        two = ShardedTensor.from_rank_offsets("t", torch.full((3,), val + 1), (0, 1, 2))
        single = ShardedTensor.from_rank_offsets("s", torch.arange(4.0) + val)
        return {
            "t": LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(one), CheckpointableShardedTensor.from_sh_ten(two)]),
            "s": CheckpointableShardedTensor.from_sh_ten(single),
        }

    dcp.save(state(3.0), checkpoint_id=str(tmp_path))
    meta = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert tuple(meta.state_dict_metadata["t"].size) == (6,)
    loaded = state(10.0)
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    assert [s._sh_ten.data.tolist() for s in loaded["t"]._local_shards] == [[3.0] * 3, [4.0] * 3]
    assert loaded["s"]._sh_ten.data.tolist() == [3.0, 4.0, 5.0, 6.0]


def _package_imports(package_dir):
    """Module -> [(imported package-internal module, nested in a statement)] of every module
    under ``package_dir`` (the ``tessera`` package), read from the source: ``from a import b``
    counts as an import of module ``a.b`` when that is a module, of ``a`` otherwise."""
    import ast
    from pathlib import Path

    root = Path(package_dir)
    paths = {}
    for path in root.rglob("*.py"):
        parts = ("tessera",) + path.relative_to(root).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    imports = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in paths else source for a in node.names]
            else:
                continue
            # Nested: inside a function, class, try or if (column > 0), not at the module's top.
            found += [(t, node.col_offset > 0) for t in targets if t.split(".")[0] == "tessera" and t != module]
        imports[module] = found
    return imports


def _circles(graph):
    """The strongly connected groups of more than one module (each holds an import circle)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_package_imports_form_no_circle_and_stay_at_module_level():
    """No module of the tessera package imports another of it inside a function (or a try, an
    if) to dodge a circle, and the imports form no circle; every module of
    ``tessera.dist_checkpointing`` then imports, in a fresh interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    import tessera

    package_dir = Path(tessera.__file__).parent
    imports = _package_imports(package_dir)
    nested = sorted(f"{module} imports {target}" for module, found in imports.items() for target, inner in found if inner)
    assert not nested, "package-internal imports below module level:\n" + "\n".join(nested)
    graph = {module: {target for target, _ in found if target in imports} for module, found in imports.items()}
    assert not _circles(graph), f"import circles: {_circles(graph)}"
    # The front ends share the private core (tessera._core), never each other's names.
    fronts = ("tessera.torch", "tessera.olmo_core", "tessera.dist_checkpointing")

    def front(name):
        return next((f for f in fronts if name == f or name.startswith(f + ".")), None)

    crossing = sorted(
        f"{module} imports {target}"
        for module, found in imports.items()
        for target, _ in found
        if front(module) and front(target) and front(target) != front(module)
    )
    assert not crossing, "front ends importing each other:\n" + "\n".join(crossing)

    modules = sorted(m for m in imports if m.startswith("tessera.dist_checkpointing"))
    assert "tessera.dist_checkpointing._engine" in modules and "tessera.dist_checkpointing.strategies.torch" in modules
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint('ok')\n"
    env = {"PYTHONPATH": str(package_dir.parent), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_import_checks_see_nested_imports_and_circles(tmp_path):
    """The walk of the test above finds what it looks for: a circle, and a function's import."""
    package = tmp_path / "tessera"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .a import x\n")
    imports = _package_imports(package)
    assert imports["tessera.b"] == [("tessera.a", True)]
    assert _circles({m: {t for t, _ in found} for m, found in imports.items()}) == [["tessera.a", "tessera.b"]]


def test_install_as_megatron_aliases_every_module():
    import subprocess
    import sys

    code = (
        "import sys, importlib\n"
        "import tessera.dist_checkpointing as dc\n"
        "dc.install_as_megatron('fake_megatron_dc')\n"
        "assert sys.modules['fake_megatron_dc'] is dc\n"
        "for name in dc.MEGATRON_MODULES:\n"
        "    assert sys.modules['fake_megatron_dc.' + name] is importlib.import_module('tessera.dist_checkpointing.' + name), name\n"
        "from fake_megatron_dc.strategies.torch import TorchDistSaveShardedStrategy\n"
        "from fake_megatron_dc.optimizer import KEEP_VARS_HINT\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_empty_state_dict_saves(tmp_path):
    """A rank may have nothing to save (Megatron's test_out_of_order_load: one tensor, on one
    rank): its empty state dict is no common value at the root."""
    assert _engine.split_state_dict({}) == ([], [], [])
    dc.save({}, str(tmp_path / "td"), ("torch_dist", 1))
    assert dc.load({}, str(tmp_path / "td")) == {}
    dc.save({}, str(tmp_path / "native"))
    assert dc.load({}, str(tmp_path / "native")) == {}


def test_empty_tensor_for_exchange_is_looked_up_at_call_time(monkeypatch):
    """The exchange calls ``exchange_utils._get_empty_tensor_for_exchange`` as the module holds
    it (Megatron's tests patch it there), and the function defined there once the name is gone
    (a patcher going through an alias object restores it onto the alias, not the module)."""
    from tessera.dist_checkpointing import exchange_utils

    def replacement(*args):
        raise AssertionError("not called")

    monkeypatch.setattr(exchange_utils, "_get_empty_tensor_for_exchange", replacement)
    assert exchange_utils._empty_tensor_for_exchange() is replacement
    monkeypatch.delattr(exchange_utils, "_get_empty_tensor_for_exchange")
    assert exchange_utils._empty_tensor_for_exchange() is exchange_utils._GET_EMPTY_TENSOR_FOR_EXCHANGE


def test_a_torch_dist_strategy_called_directly_keeps_the_common_state(tmp_path):
    # Megatron's serialization.save writes common.pt through its common strategy, then calls
    # strategy.save(sharded_part): that save must not replace common.pt with an empty dict.
    import torch

    from tessera.dist_checkpointing import ShardedTensor
    from tessera.dist_checkpointing import serialization as ser
    from tessera.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
    from tessera.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    TorchCommonSaveStrategy("torch", 1).save_common({"iteration": 7, "args": {"lr": 0.5}}, ckpt)
    TorchDistSaveShardedStrategy("torch_dist", 1).save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, ckpt)
    assert (ckpt / ".metadata").exists()
    assert ser.load_common_state_dict(ckpt) == {"iteration": 7, "args": {"lr": 0.5}}
    assert torch.equal(ser.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, ckpt)["w"], torch.arange(4.0))


class _Counter:
    """A Stateful value in the common state (torch DCP's protocol)."""

    def __init__(self, n=0):
        self.n, self.seen = n, (0, 0)

    def state_dict(self):
        return {"n": self.n, "seen": self.seen}

    def load_state_dict(self, sd):
        self.n, self.seen = sd["n"], sd["seen"]


@pytest.mark.parametrize("backend", [None, ("torch_dist", 1)])
def test_stateful_and_tuple_common_values_round_trip(tmp_path, backend):
    path = str(tmp_path / "s")
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(2.0)), "c": _Counter(5), "betas": (0.9, 0.95)}
    sd["c"].seen = (1, 2)
    dc.save(sd, path, backend)
    fresh = _Counter()
    out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2)), "c": fresh, "betas": (0, 0)}, path)
    assert out["c"] is fresh and fresh.n == 5 and fresh.seen == (1, 2)
    assert out["betas"] == (0.9, 0.95) and out["w"].tolist() == [0.0, 1.0]
    # Megatron's common state keeps exact types: a tuple the request does not name stays one.
    assert dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, path)["betas"] == (0.9, 0.95)
