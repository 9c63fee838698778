"""Writes the pickled DCP ``Metadata`` of a large sharded checkpoint, built with torch's own
classes, without any tensor data: RANKS row shards of TENSORS bf16 tensors of 4096 x 1024.
``scripts/unpickle_budget.sh`` measures which unpickler memory budget such metadata needs.

Usage: python scripts/make_dcp_metadata.py RANKS TENSORS OUT
"""
import pickle, sys, torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata, ChunkStorageMetadata, TensorProperties, MetadataIndex
from torch.distributed.checkpoint.filesystem import _StorageInfo
ranks, tensors = int(sys.argv[1]), int(sys.argv[2])
md, sd = {}, {}
for t in range(tensors):
    fqn = f"model.layers.{t//10}.mlp.experts.weight_{t%10}"
    rows = 4096
    chunks = []
    for r in range(ranks):
        off = torch.Size([r * rows // ranks, 0]); size = torch.Size([rows // ranks, 1024])
        chunks.append(ChunkStorageMetadata(offsets=off, sizes=size))
        sd[MetadataIndex(fqn, off, None)] = _StorageInfo(relative_path=f"__{r}_0.distcp", offset=t * 1000, length=12345678)
    md[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.bfloat16), size=torch.Size([rows, 1024]), chunks=chunks)
m = Metadata(state_dict_metadata=md, planner_data=None, storage_data=sd)
data = pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)
open(sys.argv[3], "wb").write(data)
print(len(data))
