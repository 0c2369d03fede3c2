"""One rank of the torch.distributed test (tests/test_torch_sharded.py), run as its own
process: a 2x2 CPU device mesh over gloo, DTensor parameters with row, 2-D block, replicated
and plain placements, SGD steps published by `driftless.torch.attach_sharded`. After each
step every rank joins `full_tensor()` and rank 0 saves the gathered BF16 bits to OUT/step-N.npz.

    python torch_rank.py RANK WORLD URL INIT_FILE KEY_PATH OUT STEPS
"""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import driftless
import driftless.torch


def main():
    rank, world, url, init, key, out, steps = sys.argv[1:8]
    rank, world, steps = int(rank), int(world), int(steps)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank

    def full(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.bfloat16)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # Tensor parallel on rows, replicated over data parallel (odd sizes: uneven shards).
            self.row = torch.nn.Parameter(distribute_tensor(full(301, 700), mesh, [Replicate(), Shard(0)]))
            # FSDP rows x tensor-parallel columns: a 2-D block per rank.
            self.block = torch.nn.Parameter(distribute_tensor(full(257, 1030), mesh, [Shard(0), Shard(1)]))
            self.norm = torch.nn.Parameter(distribute_tensor(full(700), mesh, [Replicate(), Replicate()]))
            self.plain = torch.nn.Parameter(full(16, 16))

    model = M()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with open(key) as f:
        pem = f.read()
    pub = driftless.ShardedPublisher(url, rank, world, signing_key=pem, anchor_every=2, commit_timeout=30.0,
                                     new_stream=True)
    driftless.torch.attach_sharded(pub, model, opt, start_step=1)
    for step in range(1, steps + 1):
        for p in model.parameters():
            grad = full(*p.shape)
            p.grad = distribute_tensor(grad, mesh, p.placements) if hasattr(p, "placements") else grad
        opt.step()  # the hook publishes this rank's shards of `step`
        gathered = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).view(torch.int16).numpy().view(np.uint16)
            for n, p in model.named_parameters()
        }
        if rank == 0:
            np.savez(os.path.join(out, f"step-{step}.npz"), **gathered)
    if rank != 0:
        pub.flush()
    pub.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
