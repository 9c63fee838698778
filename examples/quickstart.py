import sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import tessera.torch as tt

def train(rank, path, port):  # 2 ranks, each holding half of the rows of "w"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    w = distribute_tensor(torch.arange(12.0).reshape(4, 3), init_device_mesh("cpu", (2,)), [Shard(0)])
    tt.save({"model": {"w": w}, "step": 100}, path, overwrite=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    path, port = (sys.argv[1:] + ["/tmp/tessera-quickstart", "29517"])[:2]
    mp.spawn(train, args=(path, port), nprocs=2)
    state = {"model": {"w": torch.zeros(4, 3)}, "step": 0}  # one process, whole tensors
    tt.load(state, path)
    print(state["step"], state["model"]["w"][3].tolist())  # 100 [9.0, 10.0, 11.0]
