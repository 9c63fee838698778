"""Checkpoints at ``s3://`` URLs from Python: `tessera.dist_checkpointing` and `tessera.torch`
against an S3 server: moto_server, started here on a free loopback port (unless
``TESSERA_TEST_S3_ENDPOINT`` names a running S3-compatible server). The store is configured
the way users do it, through the AWS environment variables."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Iterator

import pytest
import torch

from tessera._launch import run_ranks
from servers import free_port, start_on_loopback
from tessera import dist_checkpointing as dc
from tessera.dist_checkpointing import ShardedObject, ShardedTensor
from tessera.errors import AlreadyExistsError, NotFoundError

BUCKET = "tessera-test"


def _moto_server() -> str:
    venv = Path(sys.executable).parent / "moto_server"
    found = str(venv) if venv.exists() else shutil.which("moto_server")
    if found is None:
        pytest.fail("no moto_server: install requirements-dev.txt (moto[server]) or set TESSERA_TEST_S3_ENDPOINT")
    return found


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """``http://host:port`` of an S3 server with the test bucket."""
    endpoint = os.environ.get("TESSERA_TEST_S3_ENDPOINT")
    proc = None
    if not endpoint:
        port = free_port()
        proc = start_on_loopback([_moto_server(), "-H", "127.0.0.1", "-p", str(port)], port)
        endpoint = f"http://127.0.0.1:{port}"
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1"
    )
    try:
        client.create_bucket(Bucket=BUCKET)
    except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        pass
    try:
        yield endpoint
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture
def s3_url(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], str]:
    """``s3_url(tag)``: a fresh ``s3://`` location; the AWS environment points at the server
    (in this process and in the processes it spawns)."""
    env = {
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return lambda tag: f"s3://{BUCKET}/{tag}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _truth() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        # 18 MiB: more than one 16 MiB part, so the data file is a multipart upload.
        "big": torch.randn(4608, 1024, generator=g),
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(32, generator=g).to(torch.bfloat16),
        "steps": torch.arange(10, dtype=torch.int64),
    }


def test_save_and_load_at_an_s3_url_in_one_process(s3_url: Callable[[str], str]) -> None:
    url = s3_url("py-solo")
    truth = _truth()
    sd = {k: ShardedTensor.from_rank_offsets(k, t.clone()) for k, t in truth.items()}
    sd["rng"] = ShardedObject("rng_state", {"seed": 3, "state": [1, 2]}, (1,), (0,))
    sd["iteration"] = 7
    dc.save(sd, url, content_metadata={"step": 7})

    # A resharded request: two row blocks of "w", a column block of "big".
    request = {
        "w_top": ShardedTensor("w", torch.zeros(16, 32), torch.float32, (16, 32), (64, 32), (0, 0), None),
        "w_bottom": ShardedTensor("w", torch.zeros(16, 32), torch.float32, (16, 32), (64, 32), (48, 0), None),
        "big_cols": ShardedTensor(
            "big", torch.zeros(4608, 100), torch.float32, (4608, 100), (4608, 1024), (0, 500), None
        ),
        "b": ShardedTensor.from_rank_offsets("b", torch.zeros(32, dtype=torch.bfloat16)),
        "rng": ShardedObject("rng_state", None, (1,), (0,)),
    }
    state = dc.load(request, url)
    assert torch.equal(state["w_top"], truth["w"][:16])
    assert torch.equal(state["w_bottom"], truth["w"][48:])
    assert torch.equal(state["big_cols"], truth["big"][:, 500:600])
    assert torch.equal(state["b"], truth["b"])
    assert state["rng"] == {"seed": 3, "state": [1, 2]}
    assert state["iteration"] == 7

    plain = dc.load_plain_tensors(url)
    assert set(plain) == set(truth)
    for k, t in truth.items():
        assert torch.equal(plain[k], t), k
    meta = dc.load_tensors_metadata(url)
    assert tuple(meta["big"].global_shape) == (4608, 1024) and meta["b"].dtype == torch.bfloat16
    assert dc.load_common_state_dict(url)["iteration"] == 7
    assert dc.load_content_metadata(url) == {"step": 7}

    from tessera.torch import unshard

    full = unshard(url, ["w", "steps"])
    assert set(full) == {"w", "steps"}
    assert torch.equal(full["w"], truth["w"]) and torch.equal(full["steps"], truth["steps"])

    # The commit is create-if-absent: a second save into the same URL is refused.
    with pytest.raises(AlreadyExistsError):
        dc.save({"x": ShardedTensor.from_rank_offsets("x", torch.ones(3))}, url)
    assert torch.equal(dc.load_plain_tensors(url)["w"], truth["w"])


def test_a_missing_s3_checkpoint_is_not_found(s3_url: Callable[[str], str]) -> None:
    with pytest.raises(NotFoundError):
        dc.load_plain_tensors(s3_url("py-missing"))


ROWS, COLS = 256, 128


def _global(key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(11 if key == "w" else 12)
    return torch.randn(ROWS, COLS, generator=g) if key == "w" else torch.randn(COLS, generator=g)


def _save_then_reshard(rank: int, world: int, url: str) -> None:
    import torch.distributed as dist

    w, b = _global("w"), _global("b")
    rows = ROWS // world
    # Save: "w" split by rows (TP), "b" replicated on every rank.
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", w[rank * rows : (rank + 1) * rows].clone(), (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", b.clone(), replica_id=rank),
        "iteration": 3,
    }
    dc.save(sd, url)
    dist.barrier()
    # Load, resharded: "w" split by columns, and "b" whole.
    cols = COLS // world
    request = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, cols), (1, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", torch.zeros(COLS), replica_id=rank),
    }
    state = dc.load(request, url)
    assert torch.equal(state["w"], w[:, rank * cols : (rank + 1) * cols]), rank
    assert torch.equal(state["b"], b), rank
    assert state["iteration"] == 3


def test_two_process_save_and_resharded_load_on_s3(s3_url: Callable[[str], str]) -> None:
    url = s3_url("py-gloo")
    # The spawned ranks inherit the AWS environment set by the fixture.
    run_ranks(2, _save_then_reshard, url)
    plain = dc.load_plain_tensors(url)
    assert torch.equal(plain["w"], _global("w"))
    assert torch.equal(plain["b"], _global("b"))


@contextlib.contextmanager
def _load_stats() -> Iterator[Dict[str, int]]:
    """The read statistics of the loads made inside the block (tessera's one native load)."""
    from tessera._core import io

    stats: Dict[str, int] = {}
    real = io.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        stats.update(result["stats"])
        return result

    io.load = spy  # type: ignore[assignment]
    try:
        yield stats
    finally:
        io.load = real  # type: ignore[assignment]


def _torch_load_by_columns(rank: int, world: int, url: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import tessera.torch as tt

    full = _wide()
    with _load_stats() as stats:
        # Columns: every checksum block of "w" holds bytes of both ranks.
        w = distribute_tensor(torch.zeros_like(full), init_device_mesh("cpu", (world,)), [Shard(1)])
        state = {"model": {"w": w}}
        tt.load(state, url)
    assert torch.equal(state["model"]["w"].full_tensor(), full)
    assert stats["bytes_read"] <= 1.05 * stats["bytes_needed"], stats


def _wide() -> torch.Tensor:
    return torch.randn(1024, 1024, generator=torch.Generator().manual_seed(5))  # 4 MiB: 4 blocks


def test_ranks_loading_through_tessera_torch_share_verification(s3_url: Callable[[str], str]) -> None:
    """Two ranks load halves of every checksum block: together they check the blocks, and each
    downloads only the bytes it needs (alone, each would download every block whole: 2x)."""
    import tessera.torch as tt

    url = s3_url("py-shared")
    tt.save({"model": {"w": _wide()}}, url)
    run_ranks(2, _torch_load_by_columns, url)


def _dist_checkpointing_load_by_columns(rank: int, world: int, url: str) -> None:
    full = _wide()
    cols = full.shape[1] // world
    with _load_stats() as stats:
        # Columns: every checksum block of "w" holds bytes of both ranks.
        request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(full.shape[0], cols), (1, rank, world))}
        state = dc.load(request, url)
    assert torch.equal(state["w"], full[:, rank * cols : (rank + 1) * cols]), rank
    assert stats["bytes_read"] <= 1.05 * stats["bytes_needed"], stats


def test_ranks_loading_through_dist_checkpointing_share_verification(s3_url: Callable[[str], str]) -> None:
    """Megatron's load is called by every rank: ``dist_checkpointing.load`` is collective in
    its default mode too, so two ranks loading halves of every checksum block check the blocks
    together, and each downloads only the bytes it needs (alone, each would download every
    block whole: 2x)."""
    url = s3_url("py-dc-shared")
    dc.save({"w": ShardedTensor.from_rank_offsets("w", _wide())}, url)
    run_ranks(2, _dist_checkpointing_load_by_columns, url)
