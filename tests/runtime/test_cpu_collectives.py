"""The collective counts of the CPU model (core/cost/cpu_model.py) are the runtime's own.

One process on torch's fake process group (no peers, collectives are no-ops): the tiny model is
parallelised by `runtime/engine/parallelize.py` as a 4-rank job would be, two micro-batches run
forward + backward under a dispatch mode that counts c10d ops, and the counts per micro-batch
must equal `GlooCpuStepTimeModel.tp_calls` / `fsdp_calls`. A subprocess keeps the fake default
group out of the test process.
"""

import json
import os
import subprocess
import sys

import numpy as np

from copus.core.cost.cpu_model import GlooCpuStepTimeModel
from copus.core.cost.fit import prior_model
from copus.core.specs.resolve import get_model_shape

COUNT = r"""
import collections, json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.device_mesh import init_device_mesh
from copus.core.specs.resolve import get_model_shape
from copus.runtime.engine.model import build_model, materialize
from copus.runtime.engine.parallelize import parallelize
from copus.runtime.engine.pipeline import split_stage

class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if "c10d" in name and "wait" not in name and "wrap" not in name:
            self.calls[name.split(".")[-1].strip("_")] += 1
        return func(*args, **(kwargs or {}))

torch.set_num_threads(1)
dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
shape = get_model_shape("tiny")
out = {}
for dp, tp, pp in ((2, 2, 1), (1, 2, 2), (4, 1, 1)):
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    model = build_model(shape, "meta")
    if pp > 1:
        split_stage(model, pp - 1, pp)          # the last stage (head), as the model prices
    model = materialize(parallelize(model, mesh), "cpu", 0)
    if pp > 1:
        x = torch.randn(1, shape.seq_len, shape.dim, requires_grad=True)
    else:
        x = torch.randint(0, shape.vocab_size, (1, shape.seq_len))
    k = 2
    with Count() as c:
        for i in range(k):
            model.set_requires_gradient_sync(i == k - 1)
            model(x).float().pow(2).mean().backward()
    out[f"{dp}.{tp}.{pp}"] = dict(c.calls)
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_model_counts_equal_the_runtime_collectives_per_microbatch():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", COUNT], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    model = prior_model(get_model_shape("tiny"), None, 4, cores=2)
    assert isinstance(model, GlooCpuStepTimeModel)
    k = 2
    for key, calls in counts.items():
        dp, tp, pp = (int(v) for v in key.split("."))
        parts = model.breakdown(dp, tp, pp, 1, k)
        n_ar, n_ag = (float(v) for v in model.tp_calls(tp, pp))
        tp_calls = calls.get("all_reduce", 0) + calls.get("all_gather_into_tensor", 0)
        assert tp_calls == k * float(parts["tp_calls"]), (key, calls)
        assert calls.get("all_reduce", 0) == k * n_ar and calls.get("all_gather_into_tensor", 0) == k * n_ag
        units = float(model.stage_layers(pp)) + 1
        if pp == 1:  # FSDP2 outside a pipeline (inside one, PipelineStage halves the gathers)
            assert calls.get("allgather_base", 0) == k * float(parts["fsdp_calls"]), (key, calls)
            assert calls.get("reduce_scatter_base", 0) == (units if dp > 1 else 0), (key, calls)
    assert np.isclose(float(model.tp_calls(2, 1)[0]), 30)
