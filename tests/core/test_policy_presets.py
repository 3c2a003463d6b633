from copus.config import load_config
from copus.core.control.policy_presets import POLICY_PRESETS, apply_policy_preset


def test_goodput_copus_is_the_papers_settings_and_goodput_is_not():
    paper = load_config(None, ["batch.policy='goodput-copus'"])
    assert (paper.gns.calibration, paper.gns.estimator, paper.gns.decay, paper.gns.decay_late,
            paper.gns.confidence, paper.gns.recovery_steps) == (2.0, "ema", 0.95, 0.99, 0.0, 0)
    assert paper.controller.lr_aware is True and paper.train.lr_rule == "sqrt"
    # issue 26: the paper's algorithm alone: no accuracy gate, probes, audits or step bound
    assert paper.gns.max_rel_err >= 1e9 and paper.controller.explore_max_probes == 0
    assert paper.controller.audit_steps == 0 and paper.controller.step_confidence == 0.0
    ours = load_config(None, [])
    assert ours.batch.policy == "goodput"
    assert (ours.gns.calibration, ours.gns.estimator, ours.controller.lr_aware) == \
        ("auto", "tracking", False)


def test_explicit_keys_win_over_the_preset_and_round_trip(tmp_path):
    cfg = load_config(None, ["batch.policy='goodput-copus'", "gns.calibration=1.0"])
    assert cfg.gns.calibration == 1.0 and cfg.gns.estimator == "ema"
    data = {"batch": {"policy": "norm-test"}, "gns": {"calibration": 3.0}}
    assert apply_policy_preset(data) == data and apply_policy_preset(data) is not data
    assert set(POLICY_PRESETS) == {"goodput-copus"}
    from copus.config import config_to_toml
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(str(path)) == cfg
