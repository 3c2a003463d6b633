"""Pipeline parallelism: manual stage split + torch.distributed.pipelining schedules.

The manual split (cpu-notes d) keeps the full model's parameter names ("layers.5..." stays
"layers.5..."), so TP, FSDP, meta-init and DCP resharding see the same names under any pp.
A `PipelineStage` keeps shape-dependent receive buffers and a schedule infers shapes on its first
`step()`, so `Pipeline.schedule(num_microbatches, micro_batch_size)` builds a NEW schedule object
whenever that pair (or train/eval) changes and keeps only the current one (cpu-notes f).

Interleaved 1F1B (Narayanan et al. SC'21 §2.2.2; issue 25): the blocks are split into pp·v
chunks and rank r holds chunks r, r + pp, ..., r + (v−1)·pp (`chunk_stage_ids`, `split_chunks`),
each a pruned copy of the model with the same global parameter names, driven by torch's
`ScheduleInterleaved1F1B` (which needs n_microbatches to be a multiple of max(1, m // pp)).
Not yet wired into `Engine` (it builds one stage per rank); `Pipeline` takes the chunk list.
"""

from __future__ import annotations

from collections.abc import Callable

import copy
import functools
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from copus.core.plan.stages import split_layers
from copus.runtime.engine.model import Transformer

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved-1f1b": ScheduleInterleaved1F1B}
MULTI_STAGE = ("interleaved-1f1b",)


def split_stage(model: Transformer, stage_index: int, num_stages: int) -> Transformer:
    """Keep only this stage's blocks (`core.stages.split_layers`); embeddings on stage 0, final
    norm + head on the last stage. In place; returns the model."""
    if model.shape.tie_embeddings and num_stages > 1:
        raise ValueError("tie_embeddings=True is not supported with pp > 1; allowed: pp = 1")
    keep = {str(i) for i in split_layers(model.shape.n_layers, num_stages)[stage_index]}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage_index != 0:
        model.tok_embeddings = None
    if stage_index != num_stages - 1:
        model.norm = None
        model.output = None
    return model


def chunk_stage_ids(rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Global stage indices of pipeline rank `rank` under interleaving: r, r + pp, ..."""
    if not 0 <= rank < pp or virtual_stages < 1:
        raise ValueError(
            f"rank={rank}, pp={pp}, virtual_stages={virtual_stages} are invalid; "
            "allowed: 0 <= rank < pp, virtual_stages >= 1"
        )
    return [rank + k * pp for k in range(virtual_stages)]


def split_chunks(model: Transformer, rank: int, pp: int, virtual_stages: int) -> list[Transformer]:
    """This rank's `virtual_stages` chunks of `model` (copies, split as `split_stage` over pp·v
    stages); `model` itself is left whole. Cheap on a meta-device model."""
    n = pp * virtual_stages
    return [split_stage(copy.deepcopy(model), sid, n) for sid in chunk_stage_ids(rank, pp, virtual_stages)]


class Pipeline:
    """This rank's stage plus the current schedule; `run` does one training step's forward and
    backward over `num_microbatches` micro-batches (the schedule scales grads by 1/num_microbatches,
    so `loss_fn` must be a mean)."""

    def __init__(
        self,
        model: Transformer | Sequence[Transformer],
        pp_mesh: DeviceMesh,
        device: torch.device,
        schedule: str,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule={schedule!r} is invalid; allowed: {', '.join(SCHEDULES)}")
        chunks = list(model) if isinstance(model, Sequence) else [model]
        if (schedule in MULTI_STAGE) != (len(chunks) > 1):
            raise ValueError(
                f"pp_schedule={schedule!r} with {len(chunks)} model chunk(s); allowed: "
                "interleaved-1f1b with >= 2 chunks (`split_chunks`), the others with 1"
            )
        rank, pp = pp_mesh.get_local_rank(), pp_mesh.size()
        self.stage_ids = chunk_stage_ids(rank, pp, len(chunks))
        self.stage_index = rank
        self.num_stages = pp * len(chunks)
        self.stages = [
            PipelineStage(chunk, sid, self.num_stages, device, group=pp_mesh.get_group())
            for chunk, sid in zip(chunks, self.stage_ids, strict=True)
        ]
        self.stage = self.stages[0]
        self.schedule_name = schedule
        self.loss_fn = loss_fn
        self._key: tuple | None = None
        self._schedule = None

    @property
    def is_first(self) -> bool:
        """This rank feeds the inputs (holds stage 0)."""
        return self.stage_ids[0] == 0

    @property
    def is_last(self) -> bool:
        """This rank computes the loss (holds the last stage)."""
        return self.stage_ids[-1] == self.num_stages - 1

    def schedule(self, num_microbatches: int, micro_batch_size: int, train: bool = True):
        """The schedule for this micro-batching; a new object whenever the key changes."""
        key = (num_microbatches, micro_batch_size, train)
        if key != self._key:
            if self.schedule_name in MULTI_STAGE:
                self._schedule = SCHEDULES[self.schedule_name](
                    self.stages, n_microbatches=num_microbatches, loss_fn=self.loss_fn
                )
            else:
                cls = SCHEDULES[self.schedule_name] if train else ScheduleGPipe
                self._schedule = cls(self.stage, n_microbatches=num_microbatches, loss_fn=self.loss_fn)
            self._key = key
        return self._schedule

    def run(
        self, inputs: torch.Tensor, targets: torch.Tensor, num_microbatches: int, train: bool = True
    ) -> list[torch.Tensor]:
        """One pass over the local batch (chunked into `num_microbatches`); returns the per-
        micro-batch losses on the last stage, [] elsewhere."""
        sched = self.schedule(num_microbatches, inputs.shape[0] // num_microbatches, train)
        # training: the last stage keeps no micro-batch's output (logits) for a merged return
        # (torch keeps every one by default: m·s·b·V bytes; only the losses are used here)
        run = functools.partial(sched.step, return_outputs=False) if train else sched.eval
        losses: list[torch.Tensor] = []
        if self.is_first and self.is_last:
            run(inputs, target=targets, losses=losses)
        elif self.is_first:
            run(inputs)
        elif self.is_last:
            run(target=targets, losses=losses)
        else:
            run()
        return losses
