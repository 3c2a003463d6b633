"""A degree fixed in [parallel] fixes the layout for the goodput controller (as resume does)."""

from copus.config import load_config
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import ParallelPlan
from copus.runtime.train.setup import make_run_policy

PLAN = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=4, num_microbatches=1)


def _controller(overrides):
    cfg = load_config(None, ["train.max_steps=5", "parallel.nproc=2", *overrides])
    return make_run_policy(cfg, PLAN, 2, get_model_shape("tiny"))


def test_fixed_degree_disables_layout_switches():
    assert _controller([]).search_options["allow_reconfigure"] is True
    assert _controller(["parallel.dp=2"]).search_options["allow_reconfigure"] is False
    assert _controller(["parallel.pp=1"]).search_options["allow_reconfigure"] is False
    assert _controller(["controller.allow_reconfigure=false"]).search_options["allow_reconfigure"] is False


def test_activation_checkpointing_mode_prices_the_candidates():
    """The engine's AC mode (config) reaches the goodput controller's memory model: with a
    budget that only small micro-batches fit without AC, full AC admits more candidates."""
    budget = ["parallel.memory_budget_gb=0.06", "batch.max=64"]
    none = _controller(budget).candidates
    full = _controller([*budget, "parallel.activation_checkpointing=full"]).candidates
    assert len(full) > len(none) > 0


def test_tied_embeddings_keep_the_run_off_pipeline_layouts():
    """The pipeline refuses tied embeddings across stages, so a tied model's controller never
    offers pp > 1 (an untied one does, on 2 ranks)."""
    from dataclasses import replace

    cfg = load_config(None, ["train.max_steps=5", "parallel.nproc=2"])
    tiny = get_model_shape("tiny")
    untied = make_run_policy(cfg, PLAN, 2, replace(tiny, tie_embeddings=False)).candidates
    tied = make_run_policy(cfg, PLAN, 2, replace(tiny, tie_embeddings=True)).candidates
    assert (untied.pp > 1).any()
    assert len(tied) > 0 and not (tied.pp > 1).any()
