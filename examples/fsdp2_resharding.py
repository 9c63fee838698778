"""Save an FSDP2 model + AdamW state from N ranks, then load it into a different world size.

    torchrun --nproc-per-node 2 examples/fsdp2_resharding.py save /tmp/tessera-fsdp2
    torchrun --nproc-per-node 4 examples/fsdp2_resharding.py load /tmp/tessera-fsdp2
    python examples/fsdp2_resharding.py unshard /tmp/tessera-fsdp2

CPU and gloo are enough; on GPUs use NCCL and move the model to the device.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import tessera.torch as tt


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def main() -> None:
    action, ckpt = sys.argv[1], sys.argv[2]
    if action == "unshard":
        full = tt.unshard_model_state(ckpt, no_dist=True)
        for name, t in full.items():
            print(f"{name:12} {str(t.dtype):14} {tuple(t.shape)}  sum={t.float().sum():.4f}")
        return
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if action == "save":
        for _ in range(3):
            optim.zero_grad()
            model(torch.randn(8, 64)).square().mean().backward()
            optim.step()
        tt.save_model_and_optim_state(ckpt, model, optim, save_overwrite=True)
        print(f"rank {rank}/{world}: saved to {ckpt}")
    elif action == "load":
        tt.load_model_and_optim_state(ckpt, model, optim)
        local = sum(p.to_local().numel() for p in model.parameters())
        print(f"rank {rank}/{world}: loaded {local} local parameter elements, optimizer state for "
              f"{len(optim.state)} parameters")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
