"""Run a picklable function on N local gloo ranks and collect each rank's return value.

`run_ranks(fn, world_size, *args)` spawns N processes (multiprocessing "spawn"), each joins a
gloo process group on a free localhost port with `torch.set_num_threads(1)`, calls `fn(*args)`
and sends back the result (rank order). Any rank's exception is re-raised here with its
traceback; the other ranks are terminated. A successful rank ends with barrier + destroy
(FSDP2 + gloo abort at exit otherwise: cpu-notes a).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, out: Any, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(*args)
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
        os._exit(1)
    out.put((rank, True, result))
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """`[fn(*args) on rank r for r in range(world_size)]`, each rank in its own process."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, out, args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world_size:
            try:
                rank, ok, value = out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} "
                                   f"did not finish within {timeout:.0f}s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    return [results[r] for r in range(world_size)]
