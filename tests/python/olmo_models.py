"""The tiny language model the OLMo-core tests, round trips and fixtures share, and how they
wrap it (FSDP1 with ``use_orig_params``, FSDP2, DDP) and read its parameters back whole.

Imported by tests/python/test_olmo_core.py, scripts/interop/olmo_interop.py and
scripts/fixtures/make_olmo_fixtures.py (the scripts put this folder on ``sys.path``); it must work with
torch 2.7.1 (OLMo-core's venv) and the project's torch.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-norm MLP block: LayerNorm, Linear with bias, GELU, Linear without bias."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff_in = nn.Linear(dim, hidden)
        self.ff_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff_out(F.gelu(self.ff_in(self.norm(x))))


class TinyLM(nn.Module):
    """embed -> 2 x Block -> final_norm -> lm_head (``out`` logits, default ``vocab``),
    optionally times a (1,) ``logit_scale``."""

    def __init__(self, vocab: int, dim: int, hidden: int, out: Optional[int] = None, logit_scale: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, hidden) for _ in range(2)])
        self.final_norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, out or vocab, bias=False)
        self.logit_scale = nn.Parameter(torch.ones(1)) if logit_scale else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.final_norm(x))
        return logits if self.logit_scale is None else logits * self.logit_scale


def make_model(seed: int, vocab: int, dim: int, hidden: int) -> TinyLM:
    """A TinyLM with weights drawn from ``seed`` (norms perturbed away from 1 and 0)."""
    torch.manual_seed(seed)
    model = TinyLM(vocab, dim, hidden)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int, vocab: int) -> None:
    """``steps`` optimizer steps on random tokens drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (2, 5), generator=gen)
        targets = torch.randint(0, vocab, (2, 5), generator=gen)
        loss = F.cross_entropy(model(tokens).reshape(-1, vocab), targets.reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()


def wrap(kind: str, model: TinyLM) -> nn.Module:
    """``model`` under ``kind``: ``fsdp1`` (one FSDP unit per block + the root,
    ``use_orig_params=True``, CPU), ``fsdp2`` (``fully_shard`` per block, then the root),
    ``ddp``, or ``plain`` (as is). All but ``plain`` need an initialized process group."""
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if kind == "plain":
        return model
    raise ValueError(f"unknown wrapping {kind!r}")


def full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter whole, by the name of the unwrapped model's parameter (collective
    under FSDP)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}
