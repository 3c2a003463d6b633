"""Run a picklable function on N local gloo ranks and collect each rank's return value.

`run_ranks(fn, world_size, *args)` starts N processes, each joins a gloo process group on a free
localhost port with `torch.set_num_threads(1)`, calls `fn(*args)` and sends back the result
(rank order). Any rank's exception is re-raised here with its traceback; the other ranks are
terminated. A successful rank ends with barrier + destroy (FSDP2 + gloo abort at exit
otherwise: cpu-notes a).

The ranks are forked from one multiprocessing "forkserver" per test session that has imported
torch and copus's engine once (PRELOAD): a fresh "spawn" process spends ~3 s of CPU importing
them, ~12 s per 4-rank launch on 2 cores. The server is started single-threaded
(OMP_NUM_THREADS=1, so numpy's BLAS starts no pool: safe to fork), and each rank gets the
caller's environment of the moment, as a spawned process would.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "copus.runtime.engine.engine"]
_context: Any = None


def _ranks_context() -> Any:
    """The forkserver context, its server started (once) with PRELOAD imported, single-threaded."""
    global _context
    if _context is None:
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _context = ctx
    return _context


def _entry(fn: Callable, rank: int, world_size: int, port: int, out: Any, args: tuple, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's environment now, not the server's at its start
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = pickle.dumps(fn(*args))  # fail here, with a traceback, if not picklable
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
        out.close()
        out.join_thread()  # flush the queue before the hard exit
        os._exit(1)
    out.put((rank, True, result))
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """`[fn(*args) on rank r for r in range(world_size)]`, each rank in its own process."""
    ctx = _ranks_context()
    out = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, out, args, env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, ok, value = out.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
                if dead:
                    raise RuntimeError(
                        f"ranks {dead} exited without a result (exit codes {[procs[r].exitcode for r in dead]})"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world_size)) - set(results))} did not finish within {timeout:.0f}s"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    return [results[r] for r in range(world_size)]


# ------------------------------------------------------------------ single-process references
def per_sample_grads(model, tokens):
    """{name: [n, *shape]} per-sequence gradients of the mean token loss (torch.func + vmap)."""
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap
    from torch.nn.attention import SDPBackend, sdpa_kernel

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, seq):
        logits = functional_call(model, p, (seq[None, :-1],))
        return F.cross_entropy(logits[0].float(), seq[1:])

    with sdpa_kernel(SDPBackend.MATH):  # the math path has vmap batching rules (2x faster)
        return vmap(grad(loss_one), in_dims=(None, 0))(params, tokens)


def exact_stats(model, tokens, small_batch: int) -> dict:
    """Exact s̄, q and (1/J)Σ(g_jᵀḡ)² with g_j = mean gradient of consecutive `small_batch` rows."""
    import torch

    ps = per_sample_grads(model, tokens)
    flat = torch.cat([g.flatten(1) for g in ps.values()], dim=1).double()  # [n, P]
    big = flat.mean(0)
    small = flat.view(-1, small_batch, flat.shape[1]).mean(1)  # [J, P]
    return {
        "small_sqnorm": float(small.pow(2).sum(1).mean()),
        "big_sqnorm": float(big @ big),
        "ip_sq_mean": float((small @ big).pow(2).mean()),
        "grads": {k: v.mean(0) for k, v in ps.items()},
    }


def reference_train(shape, batches, lr: float, seed: int = 0, eval_tokens=None, **settings) -> list[dict]:
    """Plain single-process AdamW training with the engine's optimizer rules; per step returns
    loss (mean over the batch), q = ‖ḡ‖², the parameters after the step and (with
    `eval_tokens`) the loss on them after the step."""
    import torch
    import torch.nn.functional as F

    from copus.runtime.engine.engine import EngineSettings
    from copus.runtime.engine.model import build_model, materialize

    s = EngineSettings(**settings)
    model = materialize(build_model(shape, "cpu"), "cpu", seed)
    groups = [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": s.weight_decay},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(s.beta1, s.beta2), eps=s.eps)
    out = []
    for tokens in batches:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        q = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
        if s.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        opt.zero_grad()
        out.append(
            {
                "loss": float(loss.detach()),
                "big_sqnorm": q,
                "params": {k: v.detach().clone() for k, v in model.named_parameters()},
            }
        )
        if eval_tokens is not None:
            with torch.no_grad():
                out[-1]["eval"] = float(
                    F.cross_entropy(model(eval_tokens[:, :-1]).flatten(0, 1), eval_tokens[:, 1:].flatten())
                )
    return out
