"""reshard_after_forward=false keeps FSDP2 parameters gathered through the accumulation
(one all-gather per step): the numbers must be bit-identical to resharding every micro-batch."""

from tests.runtime._workers import run_ranks


def _three_steps(reshard_after_forward):
    import torch
    import torch.distributed as dist

    from copus.core.specs.resolve import get_model_shape
    from copus.core.plan.plan import ParallelPlan
    from copus.runtime.engine.dist import MeshCache
    from copus.runtime.engine.engine import Engine, EngineSettings

    shape = get_model_shape("tiny")
    plan = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=3)
    engine = Engine(
        shape, plan, EngineSettings(reshard_after_forward=reshard_after_forward), "cpu", MeshCache("cpu"), seed=1
    )
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    out = []
    for _ in range(3):
        tokens = torch.randint(0, shape.vocab_size, (6, shape.seq_len + 1), generator=gen)
        o = engine.train_step(tokens, lr=1e-3)
        out.append((o.loss, o.small_sqnorm, o.big_sqnorm))
    return out


def test_keeping_parameters_unsharded_during_accumulation_changes_no_number():
    assert run_ranks(_three_steps, 2, True) == run_ranks(_three_steps, 2, False)
