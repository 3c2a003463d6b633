"""A plain PyTorch FSDP2 training loop that lets copus choose the global batch size.

torchrun --nproc_per_node 2 examples/own_loop.py --policy norm-test --steps 60
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from copus.adapt import AdaptiveBatch
from copus.core.specs.resolve import get_model_shape
from copus.runtime.data.stream import GlobalSampler, TokenDataset, load_text, local_slice
from copus.runtime.data.tokenizer import ByteCodec
from copus.runtime.engine.model import build_model, materialize

ap = argparse.ArgumentParser()
ap.add_argument("--policy", default="norm-test")
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--lr", type=float, default=3e-3)
args = ap.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
shape = get_model_shape("tiny")
model = materialize(build_model(shape), "cpu", seed=0)  # your model here
for block in model.layers.values():
    fully_shard(block)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))

data = TokenDataset(ByteCodec().encode(load_text("embedded", max_chars=2_000_000)), shape.seq_len)
sampler, offset = GlobalSampler(len(data), seed=0), 0
adapt = AdaptiveBatch(
    model, policy=args.policy, initial_batch=8, micro_batch_size=2, max_batch=128, seq_len=shape.seq_len
)

for step in range(args.steps):
    ids = local_slice(sampler.ids(offset, adapt.global_batch_size), rank, world)
    offset += adapt.global_batch_size
    tokens = torch.from_numpy(data.batch(ids)).long()
    adapt.begin_step()
    total = 0.0
    for k, chunk in enumerate(tokens.chunk(adapt.num_microbatches)):
        model.set_requires_gradient_sync(adapt.is_last_microbatch(k))
        logits = model(chunk[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        (loss / adapt.num_microbatches).backward()
        total += loss.item() / adapt.num_microbatches
    decision = adapt.end_step(total)  # stats before clipping
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for group in optimizer.param_groups:
        group["lr"] = args.lr * adapt.lr_factor
    optimizer.step()
    optimizer.zero_grad()
    r = adapt.last_record
    if rank == 0:
        print(
            json.dumps(
                {
                    "step": step + 1,
                    "loss": round(r.loss, 4),
                    "global_batch_size": r.global_batch_size,
                    "b_noise": r.b_noise,
                    "decision": decision.reason if decision else None,
                }
            ),
            flush=True,
        )
dist.barrier()
dist.destroy_process_group()
