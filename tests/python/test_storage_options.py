"""Object stores configured explicitly, through ``storage_options`` (``object_store`` keys, as
polars and deltalake take them) and :class:`tessera.Location`, with nothing in the
environment: S3 against moto, Azure against Azurite (``azurite-blob``, in memory), both started
here on free loopback ports. Every API that takes a location takes them: ``tessera.torch``,
``tessera.olmo_core``, the Megatron mirror, and the command line (``--storage-option``)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from email.utils import formatdate
from pathlib import Path
from typing import Callable, Dict, Iterator

import pytest
import torch

import tessera
import tessera.torch
from tessera import dist_checkpointing as dc
from tessera.dist_checkpointing import ShardedTensor
from tessera.errors import AccessDeniedError, AlreadyExistsError, InvalidArgumentError
from servers import free_port, start_on_loopback
from test_s3 import BUCKET, s3_endpoint  # noqa: F401  (the fixture, shared)

ROOT = Path(__file__).resolve().parents[2]
ACCOUNT = "devstoreaccount1"
# Azurite's well-known development key (public, documented by Microsoft).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CONTAINER = "tessera-py"


@pytest.fixture(autouse=True)
def no_store_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing about any store in the environment: the options alone must configure it."""
    for k in list(os.environ):
        if k.startswith(("AWS_", "AZURE_", "GOOGLE_", "AZURITE_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")


def _azurite_binary() -> str:
    for candidate in (os.environ.get("TESSERA_AZURITE"), str(ROOT / "target/azurite/node_modules/.bin/azurite-blob")):
        if candidate and Path(candidate).exists():
            return candidate
    found = shutil.which("azurite-blob")
    if found is None:
        pytest.fail("no azurite-blob: run scripts/env/azurite_env.sh (npm install azurite) or set TESSERA_AZURITE")
    return found


def _create_container(endpoint: str, container: str) -> None:
    """PUT ?restype=container, signed with the account key (Shared Key)."""
    date = formatdate(usegmt=True)
    version = "2021-08-06"
    path = f"/{ACCOUNT}/{container}"
    to_sign = f"PUT\n\n\n\n\n\n\n\n\n\n\n\nx-ms-date:{date}\nx-ms-version:{version}\n/{ACCOUNT}{path}\nrestype:container"
    sig = base64.b64encode(hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest()).decode()
    host = endpoint.split("/")[2]
    req = urllib.request.Request(
        f"http://{host}{path}?restype=container",
        method="PUT",
        # No body, so that urllib adds no Content-Type (it would be part of the signed string).
        headers={
            "x-ms-date": date,
            "x-ms-version": version,
            "Authorization": f"SharedKey {ACCOUNT}:{sig}",
            "Content-Length": "0",
        },
    )
    try:
        urllib.request.urlopen(req, timeout=30).close()
    except urllib.error.HTTPError as e:
        assert e.code == 409, f"creating container {container}: HTTP {e.code}"


@pytest.fixture(scope="module")
def azure_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:PORT/devstoreaccount1`` of an Azurite with the test container."""
    endpoint = os.environ.get("TESSERA_TEST_AZURE_ENDPOINT")
    proc = None
    if not endpoint:
        port = free_port()
        argv = [_azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                "--skipApiVersionCheck", "--silent", "--loose"]
        proc = start_on_loopback(argv, port)
        endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"
    _create_container(endpoint, CONTAINER)
    try:
        yield endpoint
    finally:
        if proc is not None:
            # In memory, nothing to flush; a graceful stop waits on idle keep-alive connections.
            proc.kill()
            proc.wait(timeout=30)


def _fresh(scheme: str, bucket: str, tag: str) -> str:
    return f"{scheme}://{bucket}/{tag}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["s3", "azure"])
def store(request: pytest.FixtureRequest) -> Callable[[str], "tuple[str, Dict[str, str]]"]:
    """``store(tag)``: a fresh URL and the storage options that reach it."""
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        options = {
            "aws_endpoint": endpoint,
            "aws_allow_http": "true",
            "aws_access_key_id": "test",
            "aws_secret_access_key": "test",
            "aws_region": "us-east-1",
        }
        return lambda tag: (_fresh("s3", BUCKET, tag), options)
    endpoint = request.getfixturevalue("azure_endpoint")
    options = {
        "azure_storage_account_name": ACCOUNT,
        "azure_storage_account_key": KEY,
        "azure_storage_endpoint": endpoint,
        "azure_allow_http": "true",
    }
    return lambda tag: (_fresh("az", CONTAINER, tag), options)


def _state() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g).to(torch.bfloat16)}


def test_tessera_torch_takes_storage_options(store) -> None:
    url, options = store("torch")
    truth = _state()
    tessera.torch.save({k: v.clone() for k, v in truth.items()}, url, storage_options=options)
    target = {k: torch.zeros_like(v) for k, v in truth.items()}
    tessera.torch.load(target, url, storage_options=options)
    for k, v in truth.items():
        assert torch.equal(target[k], v), k
    assert tessera.torch.get_metadata(url, storage_options=options)["w"]["shape"] == (64, 48)
    assert torch.equal(tessera.torch.unshard(url, ["b"], storage_options=options)["b"], truth["b"])
    with pytest.raises(AlreadyExistsError):
        tessera.torch.save({"x": torch.ones(2)}, url, storage_options=options)


def test_olmo_core_mirror_takes_storage_options(store) -> None:
    from tessera.olmo_core import Checkpointer, load_model_and_optim_state, save_model_and_optim_state
    from tessera.olmo_core import unshard_model_state, unshard_optim_state

    url, options = store("olmo")
    ck = Checkpointer(storage_options=options)
    truth = _state()
    ck.save(f"{url}/plain", {k: v.clone() for k, v in truth.items()})
    assert set(ck.get_metadata(f"{url}/plain").tensors) == set(truth)
    target = {k: torch.zeros_like(v) for k, v in truth.items()}
    ck.load(f"{url}/plain", target)
    assert all(torch.equal(target[k], truth[k]) for k in truth)
    assert torch.equal(ck.unshard(f"{url}/plain")["w"], truth["w"])

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    save_model_and_optim_state(f"{url}/run", model, optim, storage_options=options)
    fresh = torch.nn.Linear(8, 4)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    load_model_and_optim_state(f"{url}/run", fresh, fresh_optim, storage_options=options)
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(unshard_model_state(f"{url}/run", storage_options=options)["bias"], model.bias.detach())
    assert unshard_optim_state(f"{url}/run", storage_options=options)["state"]


def test_megatron_mirror_takes_storage_options_and_locations(store) -> None:
    url, options = store("megatron")
    truth = _state()
    sd = {k: ShardedTensor.from_rank_offsets(k, v.clone()) for k, v in truth.items()}
    sd["iteration"] = 4
    dc.save(sd, url, storage_options=options)
    where = tessera.Location(url, options)
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64, 48))}
    assert torch.equal(dc.load(request, where)["w"], truth["w"])
    assert torch.equal(dc.load(dict(request), url, storage_options=options)["w"], truth["w"])
    assert set(dc.load_tensors_metadata(where)) == set(truth)
    assert dc.load_common_state_dict(where)["iteration"] == 4
    plain = dc.load_plain_tensors(where)
    assert torch.equal(plain["b"], truth["b"])


def test_the_cli_takes_storage_options(store) -> None:
    url, options = store("cli")
    tessera.torch.save(_state(), url, storage_options=options)
    args = [a for k, v in options.items() for a in ("--storage-option", f"{k}={v}")]
    out = subprocess.run(
        [sys.executable, "-m", "tessera", "verify", url, *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, (out.stdout, out.stderr)
    # Without the options (and with nothing in the environment, the metadata services pointed at
    # a dead port) there are no credentials: one clear error.
    dead = {"AWS_METADATA_ENDPOINT": "http://127.0.0.1:9", "AZURE_MSI_ENDPOINT": "http://127.0.0.1:9",
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT}
    out = subprocess.run([sys.executable, "-m", "tessera", "verify", url], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **dead})
    assert out.returncode != 0
    assert "credentials found: tried" in out.stderr, out.stderr


def test_a_wrong_key_is_access_denied(azure_endpoint: str) -> None:
    url = _fresh("az", CONTAINER, "wrong-key")
    options = {
        "azure_storage_account_name": ACCOUNT,
        "azure_storage_account_key": "F" + KEY[1:],
        "azure_storage_endpoint": azure_endpoint,
        "azure_allow_http": "true",
    }
    started = time.monotonic()
    with pytest.raises(AccessDeniedError) as e:
        tessera.torch.save(_state(), url, storage_options=options)
    assert e.value.path.startswith(url) and time.monotonic() - started < 10
    assert isinstance(e.value, PermissionError)


def test_locations_carry_options_everywhere(store) -> None:
    import pickle

    from tessera.olmo_core import Checkpointer

    url, options = store("location")
    where = tessera.Location(url, options)
    assert pickle.loads(pickle.dumps(where)).storage_options == options
    truth = _state()
    tessera.torch.save({k: v.clone() for k, v in truth.items()}, where)
    target = {k: torch.zeros_like(v) for k, v in truth.items()}
    tessera.torch.load(target, where)
    assert torch.equal(target["w"], truth["w"])
    olmo = tessera.Location(f"{url}-olmo", options)
    Checkpointer().save(olmo, {k: v.clone() for k, v in truth.items()})
    assert torch.equal(Checkpointer().unshard(olmo)["b"], truth["b"])
    # Option values may be secrets: the repr shows their keys only.
    shown = repr(tessera.Location("az://c/x", {"azure_storage_account_key": KEY}))
    assert "azure_storage_account_key" in shown and KEY not in shown


def test_an_unknown_option_names_itself() -> None:
    with pytest.raises(InvalidArgumentError, match="aws_no_such_key"):
        tessera.torch.get_metadata("s3://bucket/x", storage_options={"aws_no_such_key": "1"})


def test_azure_connection_string(azure_endpoint: str) -> None:
    url = _fresh("az", CONTAINER, "connection-string")
    conn = f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={azure_endpoint};"
    options = {"azure_storage_connection_string": conn}
    truth = _state()
    tessera.torch.save(truth, url, storage_options=options)
    assert torch.equal(tessera.torch.unshard(url, ["w"], storage_options=options)["w"], truth["w"])
