"""The GPU check's peer leg: torchtitan's Llama on the same shape, sequence, batch, dtype, layout,
compile and activation-checkpointing settings as copus's throughput leg, for the same steps.

torchtitan's own entry (`torchrun -m torchtitan.train`) needs its tokenizer and c4 test assets,
which a pip install does not ship, so this builds torchtitan's `Trainer` (torchtitan 0.3.0 API,
read from its source: `torchtitan/trainer.py`, `models/llama3/{__init__,config_registry}.py`)
with two components replaced: the tokenizer (none) and the dataloader (random tokens, one
document per row: `positions` = 0..s-1, so FlexAttention's document mask is the causal mask
copus's SDPA applies). Model build (meta → `parallelize_llama` → `to_empty` → `init_weights`),
FSDP2 mixed precision (bf16 parameters, fp32 reductions), compile, selective AC, optimizer
(AdamW) and `train_step` are torchtitan's. Each step is timed on the host after a device sync;
peak memory is CUDA's allocated / reserved peak and `mem_get_info`, as for copus's legs.

`unavailable()` states why the leg cannot run here (torchtitan not importable, no CUDA): the
check then records the leg as skipped with that reason. Nothing here is imported by copus.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path


def unavailable(dry_run: bool) -> str | None:
    """None when the leg can run here, else the reason (one line)."""
    try:
        import torchtitan  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "cannot run"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"torchtitan is not importable ({type(exc).__name__}: {first}); pip install torchtitan"
    if dry_run:
        return "dry run: torchtitan's trainer needs CUDA (NCCL, FlexAttention via Triton)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: torchtitan's trainer runs on GPUs"
    return None


def model_config(shape: dict, seq_len: int):
    """torchtitan's Llama3Model.Config for copus's config.json shape (the `_debugmodel` recipe
    with copus's sizes: separate q/k/v fused as torchtitan does, SwiGLU hidden = ffn width,
    plain RoPE with copus's theta, FlexAttention, untied head)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        _build_llama3_layers,
        _output_linear_init,
    )
    from torchtitan.models.llama3.model import Llama3Model

    dim, vocab = shape["hidden_size"], shape["vocab_size"]
    n_heads = shape["num_attention_heads"]
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=shape["num_hidden_layers"],
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=shape["num_key_value_heads"],
            hidden_dim=shape["intermediate_size"],
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=seq_len, theta=shape["rope_theta"], scaling="none"),
            attn_backend="flex",
        ),
    )


class _Synthetic:
    """A dataloader "config": `build(...)` returns an endless iterable of ({"input", "positions"},
    labels) of random tokens, local_batch_size rows of seq_len (torchtitan's batch contract)."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.seed = vocab, seed

    def build(self, *, dp_rank: int = 0, seq_len: int, local_batch_size: int, **_: object):
        import torch

        gen = torch.Generator().manual_seed(self.seed + dp_rank)
        vocab = self.vocab

        class _Rows:
            def __iter__(self):
                while True:
                    t = torch.randint(0, vocab, (local_batch_size, seq_len + 1), generator=gen)
                    pos = torch.arange(seq_len).expand(local_batch_size, seq_len).contiguous()
                    yield {"input": t[:, :-1], "positions": pos}, t[:, 1:]

            def state_dict(self):
                return {}

            def load_state_dict(self, state):
                return None

        return _Rows()


class _NoTokenizer:
    def build(self, **_: object):
        return None


def trainer_config(opts: dict):
    """torchtitan's Trainer.Config: the debug model's recipe with copus's leg settings."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3 import config_registry, model_registry

    cfg = config_registry.llama3_debugmodel()
    spec = model_registry("debugmodel")
    spec.model = model_config(opts["config"], opts["seq_len"])
    cfg.model_spec = spec
    cfg.loss = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=opts["config"]["vocab_size"])
    )
    t = cfg.training
    t.seq_len, t.local_batch_size, t.steps = opts["seq_len"], opts["mbs"], opts["steps"]
    t.global_batch_size = opts["global_batch_size"]
    t.mixed_precision_param, t.mixed_precision_reduce = "bfloat16", "float32"
    cfg.parallelism.data_parallel_shard_degree = opts["dp"]
    cfg.parallelism.tensor_parallel_degree = opts["tp"]
    cfg.parallelism.pipeline_parallel_degree = 1
    cfg.compile.enable = bool(opts["compile"])
    ac = opts["activation_checkpointing"]
    cfg.activation_checkpoint = SelectiveAC.Config() if ac == "selective" else FullAC.Config() if ac == "full" else None
    cfg.checkpoint.enable = False
    cfg.validator.enable = False
    cfg.metrics.log_freq = 10**9
    cfg.comm.init_timeout_seconds = cfg.comm.train_timeout_seconds = int(opts["nccl_timeout_s"])
    cfg.dump_folder = opts["run_dir"]
    cfg.tokenizer = _NoTokenizer()
    cfg.dataloader = _Synthetic(opts["config"]["vocab_size"], seed=0)
    return cfg


def worker(cfg, run_dir: str, resume: bool = False) -> dict:
    """Every rank (copus's launcher: RANK, WORLD_SIZE, MASTER_* set): torchtitan's Trainer, then
    `steps` timed `train_step`s; rank 0's step times and the fullest rank's peaks."""
    import torch
    import torch.distributed as dist
    from torchtitan.trainer import Trainer

    opts = json.loads(Path(run_dir, "leg.json").read_text())
    t0 = time.perf_counter()
    trainer = Trainer(trainer_config({**opts, "run_dir": run_dir}))
    build_s = time.perf_counter() - t0
    device = trainer.device
    # torchtitan's metrics reset CUDA's peaks after logging step 1: kept off, so its peak covers
    # every step as copus's segment peak does (compilation's first step included on both sides)
    monitor = getattr(trainer.metrics_processor, "device_memory_monitor", None)
    if monitor is not None:
        monitor.reset_peak_stats = lambda: None
    torch.cuda.reset_peak_memory_stats(device)
    data = trainer.batch_generator(trainer.dataloader)
    times = []
    for _ in range(opts["steps"]):
        trainer.step += 1
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        trainer.train_step(data)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    free, total = torch.cuda.mem_get_info(device)
    local = torch.tensor(
        [
            max(times),
            float(torch.cuda.max_memory_allocated(device)),
            float(torch.cuda.max_memory_reserved(device)),
            float(total - free),
        ],
        dtype=torch.float64,
        device=device,
    )
    step_max = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    dist.all_reduce(step_max, op=dist.ReduceOp.MAX)  # the slowest rank per step (as copus)
    slowest = step_max.tolist()
    steady = slowest[1:] or slowest
    median = statistics.median(steady)
    tokens = opts["global_batch_size"] * opts["seq_len"]
    result = {
        "build_s": build_s,
        "step_s": slowest,
        "median_step_s": median,
        "median_tokens_per_s": tokens / median,
        "first_step_s": slowest[0],
        "peak_allocated_bytes": local[1].item(),
        "peak_reserved_bytes": local[2].item(),
        "device_used_bytes": local[3].item(),
        "torchtitan_version": getattr(__import__("torchtitan"), "__version__", "?"),
        "world_size": dist.get_world_size(),
        "pid": os.getpid(),
    }
    trainer.close()
    dist.destroy_process_group()
    return result
