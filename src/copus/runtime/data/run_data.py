"""What a training run reads: datasets, tokenizer, the model shape that fits it, the sampler.

The trainer calls `build_run_data` once; everything data-dependent it needs comes back in one
`RunData`. Rules (docs/data.md):

- the model's vocabulary follows the tokenizer for byte-level shapes (`tokenizer.fit_vocab`);
- a prepared folder (data.source = DIR) is streamed from its shards and sampled by
  `FeistelSampler` (O(1) memory); in-memory text keeps `data.GlobalSampler`;
- validation is sized to hold eval.num_samples windows for text sources (`split_train_val`),
  and the evaluation adapts to a smaller held-out split (`eval_plan`);
- the run folder keeps the tokenizer (`tokenizer.json`) for `copus export`, and a resumed run
  must use the checkpoint's tokenizer (`check_resumed_tokenizer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from copus.atomic import atomic_write_text
from copus.core.specs.models import ModelShape
from copus.runtime.data import stream as data_mod
from copus.runtime.data.sampler import FeistelSampler
from copus.runtime.data.shards import is_prepared
from copus.runtime.data.tokenizer import fit_vocab

RUN_TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class RunData:
    train: Any
    val: Any
    tokenizer: Any
    shape: ModelShape
    sampler: Any


def build_run_data(cfg, shape: ModelShape) -> RunData:
    """Datasets (validation sized for eval.num_samples), tokenizer, fitted shape, sampler."""
    min_val = cfg.eval.num_samples if cfg.eval.interval_steps > 0 else 0
    train, val, tok = data_mod.build_datasets(
        cfg.data, shape.seq_len, shape.vocab_size, min_val_windows=min_val, share=rank_share(), agree=agree_on_problem
    )
    what = (
        f"the tokenizer of {cfg.data.source}"
        if is_prepared(cfg.data.source)
        else f"data.tokenizer={cfg.data.tokenizer!r}"
    )
    fitted = fit_vocab(shape, tok.vocab_size, what=what)
    sampler = (
        FeistelSampler(len(train), cfg.train.seed)
        if is_prepared(cfg.data.source)
        else data_mod.GlobalSampler(len(train), cfg.train.seed)
    )
    return RunData(train, val, tok, fitted, sampler)


def rank_share() -> tuple[int, int]:
    """(rank, world) of the default process group, (0, 1) without one: this rank's share of the
    dataset checksums (`shards.verify_folder`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agree_on_problem(problem: str) -> str:
    """The first rank's non-empty `problem` on every rank (one all_gather_object of short
    strings); `problem` itself without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return problem
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    return next((p for p in everyone if p), "")


def tokenizer_state(tok, shape: ModelShape) -> dict:
    """The trainer-state entry that ties a checkpoint to its tokenizer and vocabulary."""
    return {"sha256": tok.sha256, "vocab_size": int(tok.vocab_size), "model_vocab_size": int(shape.vocab_size)}


def check_resumed_tokenizer(saved: dict | None, tok, where: str) -> None:
    """A checkpoint written with another tokenizer is refused (one line, both hashes)."""
    if not saved or saved.get("sha256") == tok.sha256:
        return
    raise ValueError(
        f"{where} was trained with tokenizer sha256 {saved['sha256'][:16]} "
        f"(vocab {saved.get('vocab_size')}), this run's data uses sha256 "
        f"{tok.sha256[:16]} (vocab {tok.vocab_size}); allowed: the same tokenizer "
        "(data.source prepared with it)"
    )


def save_tokenizer(run_dir: Path, tok) -> None:
    """Write the run's tokenizer.json (atomically) when it has one; the byte tokenizer has none."""
    to_json = getattr(tok, "to_json", None)
    if to_json is None:
        return
    path = Path(run_dir) / RUN_TOKENIZER
    atomic_write_text(path, to_json())


def eval_rows(wanted_rows: int, num_val: int, dp: int, micro_batch_size: int, pp: int) -> int:
    """Validation rows per dp rank: `wanted_rows`, reduced to what the held-out split holds,
    a multiple of min(micro_batch_size, rows), and ≥ pp micro-batches under a pipeline (else 0)."""
    rows = max(min(wanted_rows, num_val // dp), 0)
    if rows == 0:
        return 0
    rows -= rows % min(micro_batch_size, rows)
    if pp > 1:
        rows = max(rows, pp * micro_batch_size)
    return rows if rows * dp <= num_val else 0


def eval_note(rows: int, dp: int, num_val: int, num_samples: int) -> str | None:
    """Why the evaluation uses fewer windows than eval.num_samples (or none), else None."""
    if rows * dp >= num_samples:
        return None
    if rows == 0:
        return (
            f"validation skipped: the held-out split has {num_val} windows, fewer than one "
            "evaluation batch; raise data.val_fraction or use more data"
        )
    return (
        f"validation on {rows * dp} windows: the held-out split has {num_val}, fewer than "
        f"eval.num_samples={num_samples}"
    )
