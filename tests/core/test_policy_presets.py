from copus.config import load_config
from copus.core.control.policy_presets import POLICY_PRESETS, apply_policy_preset


def test_goodput_copus_is_the_papers_settings_and_goodput_is_not():
    paper = load_config(None, ["batch.policy='goodput-copus'"])
    assert (
        paper.gns.calibration,
        paper.gns.estimator,
        paper.gns.decay,
        paper.gns.decay_late,
        paper.gns.confidence,
        paper.gns.recovery_steps,
    ) == (2.0, "ema", 0.95, 0.99, 0.0, 0)
    assert paper.controller.lr_aware is True and paper.train.lr_rule == "sqrt"
    # the paper's algorithm alone: no accuracy gate, its 10 % margin
    assert paper.gns.max_rel_err >= 1e9 and paper.controller.margin == 0.10
    ours = load_config(None, [])
    assert ours.batch.policy == "goodput"
    assert (ours.gns.calibration, ours.gns.estimator, ours.controller.lr_aware) == ("auto", "auto", False)


def test_explicit_keys_win_over_the_preset_and_round_trip(tmp_path):
    cfg = load_config(None, ["batch.policy='goodput-copus'", "gns.calibration=1.0"])
    assert cfg.gns.calibration == 1.0 and cfg.gns.estimator == "ema"
    data = {"batch": {"policy": "norm-test"}, "gns": {"calibration": 3.0}}
    assert apply_policy_preset(data) == data and apply_policy_preset(data) is not data
    assert set(POLICY_PRESETS) == {"goodput-copus", "norm-test-lau"}
    from copus.config import config_to_toml

    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(str(path)) == cfg


def test_norm_test_lau_is_the_papers_schedule_and_norm_test_keeps_copus_settings(tmp_path):
    """Lau et al. Algorithm 1 / App. C: every step, no window, no growth cap, no LR rule."""
    lau = load_config(None, ["batch.policy='norm-test-lau'"])
    b = lau.batch
    assert (b.interval_steps, b.warmup_steps, b.max_growth, b.norm_test_form, b.norm_test_eta) == (
        1,
        0,
        float("inf"),
        "per-sample",
        0.2,
    )
    assert lau.train.lr_rule == "none"
    ours = load_config(None, ["batch.policy='norm-test'"])
    assert (
        ours.batch.interval_steps,
        ours.batch.warmup_steps,
        ours.batch.max_growth,
        ours.batch.norm_test_eta,
        ours.train.lr_rule,
    ) == (10, 10, 2.0, 0.5, "sqrt")
    from copus.config import config_to_toml

    path = tmp_path / "lau.toml"
    path.write_text(config_to_toml(lau))  # inf survives the run folder's TOML
    assert load_config(str(path)) == lau


def test_paper_form_selects_per_worker_gradients_and_a_clash_is_one_line():
    cfg = load_config(None, ["batch.policy='norm-test'", "batch.norm_test_form='paper'"])
    assert cfg.gns.small == "rank"
    assert load_config(None, ["batch.norm_test_form='micro-batch'"]).gns.small == "microbatch"
    import pytest

    with pytest.raises(
        ValueError,
        match=r"^gns.small='microbatch': allowed: 'rank' with "
        r"batch.norm_test_form='paper'",
    ):
        load_config(None, ["batch.policy='norm-test'", "batch.norm_test_form='paper'", "gns.small='microbatch'"])
    with pytest.raises(ValueError, match="batch.norm_test_form='per-worker'"):
        load_config(None, ["batch.norm_test_form='per-worker'"])
    for bad in ("batch.norm_test_eta=0", "batch.norm_test_eta=-0.1", "batch.max_growth=0.5"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            load_config(None, ["batch.policy='norm-test-lau'", bad])
    with pytest.raises(
        ValueError,
        match=r"batch.initial=64: allowed: batch.min=8 <= "
        r"batch.initial <= batch.max=32",
    ):
        load_config(None, ["batch.policy='norm-test-lau'", "batch.initial=64", "batch.max=32"])
