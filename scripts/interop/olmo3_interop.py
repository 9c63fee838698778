"""Checks, with ai2-olmo-core 3.0.0's own code, that a DCP checkpoint directory loads into
OLMo-core 3.0 as the one ``save_model_and_optim_state`` wrote for the fixture does.

  olmo3_interop.py CHECKPOINT EXPECTED   CHECKPOINT: a directory with a DCP ``.metadata`` (e.g. a
                                         ``tessera convert --to dcp`` copy of the fixture);
                                         EXPECTED: a ``torch.save({"model": ..., "optim": ...})``
                                         of the full model and unflattened optimizer state dicts,
                                         as crates/tessera/tests/fixtures/olmo3/expected.pt.
  olmo3_interop.py --fixture             the fixture itself against its expected.pt (sanity).

The model is the fixture's ``TinyOlmo3`` (scripts/fixtures/make_olmo3_fixtures.py: tied embedding/head,
AdamW with two param groups). Checks, each printed as one PASS/FAIL line:

  metadata tensors       ``get_checkpoint_metadata``: the tensor keys are EXPECTED's tensors as
                         DCP flattens ``{"model", "optim"}`` (``model.<fqn>``,
                         ``optim.state.<fqn>.<name>``), same shape and dtype.
  metadata values        every other leaf (``optim.param_groups.<i>.<name>``) is a byte item
                         (``BytesStorageMetadata``), and nothing else is.
  metadata planner_data  ``planner_data`` maps every key to its path in the nested dict, as DCP's
                         own ``flatten_state_dict`` gives it.
  load w1 / load w2      ``load_model_and_optim_state`` into a fresh ``TinyOlmo3`` and a fresh
                         AdamW (no state; every hyperparameter unlike the saved ones), in one
                         process (plain model) and on 2 gloo ranks (FSDP2); then every tensor and
                         every param_group value (type and value: a list where a tuple was saved
                         fails) of the full state dicts equals EXPECTED, and the tie holds.
  unshard_checkpoint     its ``model.pt`` and ``optim.pt`` equal EXPECTED.
  load_keys ...          ``load_keys`` of ``model``, of every ``model.<fqn>``, of ``optim.state``
                         and of ``optim.param_groups`` equal EXPECTED's. (OLMo-core 3.0 cannot
                         load a single optimizer key such as ``optim.param_groups.0.lr`` or
                         ``optim.state.embed.weight.exp_avg`` by name from any checkpoint: its
                         ``_get_key`` splits at every dot and does not index lists.)

Exits 1 if any check fails. Run in .venv-olmo3 (bash scripts/interop/olmo3_interop.sh makes it); tessera
itself is not needed.
"""

from __future__ import annotations

import contextlib
import io
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import make_olmo3_fixtures as fx  # noqa: E402  (the fixture's model, optimizer and comparison)

FIXTURE = fx.DEFAULT_OUT
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def expected_layout(expected: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """EXPECTED as DCP flattens it: {key: leaf} and {key: path} (torch's own flattening)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, paths = flatten_state_dict(expected)
    return flat, paths


def check_metadata(ckpt: str, expected: Dict[str, Any]) -> List[Tuple[str, List[str]]]:
    from olmo_core.distributed.checkpoint import get_checkpoint_metadata
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    md = get_checkpoint_metadata(ckpt)
    flat, paths = expected_layout(expected)
    items = md.state_dict_metadata
    tensors: List[str] = []
    for key, want in flat.items():
        if not isinstance(want, torch.Tensor):
            continue
        got = items.get(key)
        if not isinstance(got, TensorStorageMetadata):
            tensors.append(f"{key}: {type(got).__name__ if got is not None else 'missing'}, want a tensor")
        elif tuple(got.size) != tuple(want.shape) or got.properties.dtype != want.dtype:
            tensors.append(f"{key}: {got.properties.dtype} {list(got.size)}, want {want.dtype} {list(want.shape)}")
    values: List[str] = []
    for key, want in flat.items():
        if isinstance(want, torch.Tensor):
            continue
        got = items.get(key)
        if not isinstance(got, BytesStorageMetadata):
            values.append(f"{key}: {type(got).__name__ if got is not None else 'missing'}, want a byte item")
    for key in sorted(set(items) - set(flat)):
        (values if isinstance(items[key], BytesStorageMetadata) else tensors).append(f"{key}: not in EXPECTED")
    planner: List[str] = []
    if not isinstance(md.planner_data, dict):
        planner.append(f"planner_data is {md.planner_data!r}, want a dict of every key's path")
    else:
        for key in items:
            got_path, want_path = md.planner_data.get(key), paths.get(key)
            if want_path is not None and (got_path is None or tuple(got_path) != tuple(want_path)):
                planner.append(f"{key}: {got_path!r}, want {tuple(want_path)!r}")
    return [("metadata tensors", tensors), ("metadata values", values), ("metadata planner_data", planner)]


def load_problems(ckpt: str, expected: Dict[str, Any], world: int) -> List[str]:
    import olmo_core.distributed.checkpoint as olmo

    model = fx.make_model(seed=1)
    if world > 1:
        fx.shard(model, world)
    optim = fx.make_optimizer(model, fresh=True)
    olmo.load_model_and_optim_state(ckpt, model, optim)
    got = fx.full_state(model, optim)
    problems = fx.differences(got, expected) if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0 else []
    if model.head.weight is not model.embed.weight:
        problems.append("head.weight is no longer tied to embed.weight")
    return problems


def load_rank(rank: int, world: int, ckpt: str, expected_path: str, result: str) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    try:
        problems = load_problems(ckpt, torch.load(expected_path, weights_only=False), world)
    except Exception:
        raise
    except BaseException as e:  # DCP's CheckpointException: as an Exception, so that the
        # launcher hands it to the parent (which ends the other rank) instead of printing it
        raise RuntimeError(raised(e)) from None
    every: List[Any] = [None] * world
    dist.all_gather_object(every, problems)
    if rank == 0:
        torch.save([f"rank {r}: {p}" for r, ps in enumerate(every) for p in ps], result)


def check_load_w2(ckpt: str, expected_path: str) -> List[str]:
    with tempfile.TemporaryDirectory() as tmp:
        result = f"{tmp}/problems.pt"
        fx.run_ranks(2, load_rank, ckpt, expected_path, result)
        return torch.load(result, weights_only=False)


def check_unshard(ckpt: str, expected: Dict[str, Any]) -> List[str]:
    from olmo_core.distributed.checkpoint import unshard_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(io.StringIO()):  # quiet=True still prints blank lines
            model_pt, optim_pt = unshard_checkpoint(ckpt, tmp, optim=True, quiet=True)
        assert optim_pt is not None
        got = {"model": torch.load(model_pt, weights_only=False), "optim": torch.load(optim_pt, weights_only=False)}
    return fx.differences(got, expected)


def check_load_keys(ckpt: str, keys: List[str], want: List[Any]) -> List[str]:
    from olmo_core.distributed.checkpoint import load_keys

    got = list(load_keys(ckpt, keys))
    problems: List[str] = []
    for key, g, w in zip(keys, got, want):
        problems += fx.differences(g, w, key)
    return problems


def raised(e: BaseException) -> str:
    """What a check that raised reports: the exception's type and the last line of its text
    (for DCP's CheckpointException and a rank's ProcessRaisedException, which carry whole
    tracebacks, that is the error that ended the innermost one)."""
    lines = [line.strip() for line in "".join(traceback.format_exception_only(type(e), e)).splitlines() if line.strip()]
    return f"raised {type(e).__name__}: {lines[-1][:400] if lines else ''}"


def main() -> int:
    from importlib.metadata import version

    args = sys.argv[1:]
    if args == ["--fixture"]:
        ckpt, expected_path = FIXTURE / "model_and_optim", FIXTURE / "expected.pt"
    elif len(args) == 2 and not args[0].startswith("-"):
        ckpt, expected_path = Path(args[0]), Path(args[1])
    else:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    ckpt, expected_path = ckpt.resolve(), expected_path.resolve()
    print(f"torch {torch.__version__}, ai2-olmo-core {version('ai2-olmo-core')}: {ckpt} against {expected_path}")
    expected = torch.load(expected_path, weights_only=False)
    model_keys = list(expected["model"])

    results: List[Tuple[str, bool]] = []

    def report(name: str, problems: List[str]) -> None:
        results.append((name, not problems))
        print(f"{'PASS' if not problems else 'FAIL'}  {name}" + ("" if not problems else f": {len(problems)} problem(s)"))
        for p in problems[:20]:
            print(f"        {p}")
        if len(problems) > 20:
            print(f"        ... and {len(problems) - 20} more")

    def run(name: str, fn: Callable[[], List[str]]) -> None:
        try:
            problems = fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            problems = [raised(e)]
        report(name, problems)

    try:
        meta = check_metadata(str(ckpt), expected)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        meta = [("metadata", [raised(e)])]
    for name, problems in meta:
        report(name, problems)
    run("load w1 (plain model, fresh AdamW)", lambda: load_problems(str(ckpt), expected, 1))
    run("load w2 (FSDP2 on 2 gloo ranks, fresh AdamW)", lambda: check_load_w2(str(ckpt), str(expected_path)))
    run("unshard_checkpoint (model.pt, optim.pt)", lambda: check_unshard(str(ckpt), expected))
    run("load_keys ['model']", lambda: check_load_keys(str(ckpt), ["model"], [expected["model"]]))
    run(
        f"load_keys model.<fqn> ({len(model_keys)} keys)",
        lambda: check_load_keys(str(ckpt), [f"model.{k}" for k in model_keys], [expected["model"][k] for k in model_keys]),
    )
    run(
        "load_keys ['optim.state', 'optim.param_groups']",
        lambda: check_load_keys(
            str(ckpt), ["optim.state", "optim.param_groups"], [expected["optim"]["state"], expected["optim"]["param_groups"]]
        ),
    )
    passed = sum(ok for _, ok in results)
    print(f"olmo3_interop: {passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
