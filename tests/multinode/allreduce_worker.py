"""A plain torch.distributed gloo all_reduce, run by torchrun on each namespaced host.

Writes `<out_dir>/rank<RANK>.json` with what this rank saw, so the test can check that every
rank took part, that the sum is right, and which node (GROUP_RANK) each rank ran on.
"""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    gathered = [None] * world
    dist.all_gather_object(gathered, os.environ.get("COPUS_TEST_HOST_ADDR", ""))
    dist.barrier()
    dist.destroy_process_group()
    record = dict(
        rank=rank,
        world_size=world,
        sum=t.item(),
        peers=gathered,
        group_rank=int(os.environ["GROUP_RANK"]),
        local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
        master_addr=os.environ["MASTER_ADDR"],
        hostname=socket.gethostname(),
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1])
