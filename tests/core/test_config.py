"""copus.config: TOML + overrides, round trip, and one-line ValueErrors naming key and value."""

import dataclasses

import pytest

from copus.config import (
    Config,
    check_run_length,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    load_config,
    parse_override,
)


def test_defaults_match_the_documented_contract():
    cfg = load_config(None, [])
    assert cfg == Config()
    assert cfg.model.name == "tiny"
    assert cfg.data.source == "embedded" and cfg.data.tokenizer == "auto"
    assert cfg.train.lr == 3e-3 and cfg.train.lr_rule == "sqrt"
    assert cfg.batch.policy == "goodput" and (cfg.batch.min, cfg.batch.initial, cfg.batch.max) == (8, 8, 256)
    assert cfg.gns.decay_switch_tokens == 8_000_000 and cfg.gns.calibration == "auto"  # issue 26
    assert cfg.gns.estimator == "auto" and cfg.gns.confidence == 1.645  # ema under goodput (robust-goodput §6.15)
    assert cfg.gns.recovery_steps == 20 and cfg.controller.lr_aware is False
    assert cfg.parallel.pp_schedule == "1f1b" and cfg.log.tensorboard is True


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[batch]\npolicy = "norm-test"\nmax = 128\n[train]\nlr = 1\n')
    cfg = load_config(str(path), ["batch.max=512", "data.source=some/folder", "parallel.activation_checkpointing=true"])
    assert cfg.batch.policy == "norm-test"
    assert cfg.batch.max == 512  # override wins over the file
    assert cfg.data.source == "some/folder"  # bare word → string
    assert cfg.parallel.activation_checkpointing == "full"  # a boolean reads as a mode
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)  # TOML int accepted as float


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(
        None,
        [
            "batch.policy=ramp",
            "train.lr=1.25e-4",
            "gns.decay=0.9",
            "data.max_chars=12345",
            "controller.lr_aware=false",
            "model.name=small",
        ],
    )
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(cfg))
    again = load_config(str(path), [])
    assert again == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_sections_are_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch.max = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.name=gpt-9", "model.name"),
        ("data.tokenizer=wordpiece", "data.tokenizer"),
        ("data.bpe_vocab_size=100", "data.bpe_vocab_size"),
        ("data.val_fraction=0.9", "data.val_fraction"),
        ("data.max_chars=-1", "data.max_chars"),
        ("data.source=''", "data.source"),
        ("train.max_steps=1.5", "train.max_steps"),
        ("train.lr=0", "train.lr"),
        ("train.lr=nan", "train.lr"),
        ("train.lr=fast", "train.lr"),
        ("train.lr_schedule=exp", "train.lr_schedule"),
        ("train.lr_rule=cube", "train.lr_rule"),
        ("train.beta2=1.0", "train.beta2"),
        ("train.min_lr_ratio=2", "train.min_lr_ratio"),
        ("train.max_nonfinite_steps=0", "train.max_nonfinite_steps"),
        ("train.dtype=fp16", "train.dtype"),
        ("parallel.nproc=0", "parallel.nproc"),
        ("parallel.tp=-2", "parallel.tp"),
        ("parallel.pp_schedule=zb", "parallel.pp_schedule"),
        ("parallel.activation_checkpointing=1", "parallel.activation_checkpointing"),
        ('parallel.activation_checkpointing="partial"', "parallel.activation_checkpointing"),
        ("train.compile=1", "train.compile"),
        ("parallel.backend=mpi", "parallel.backend"),
        ("batch.policy=adaptive", "batch.policy"),
        ("batch.initial=true", "batch.initial"),
        ("batch.initial=4", "batch.initial"),  # below batch.min=8
        ("batch.initial=1024", "batch.initial"),  # above batch.max=256
        ("batch.min=512", "batch.min"),  # above batch.max
        ("batch.max_growth=0.5", "batch.max_growth"),
        ("batch.interval_steps=0", "batch.interval_steps"),
        ("batch.ramp_kind=cubic", "batch.ramp_kind"),
        ("batch.ramp_to=1000", "batch.ramp_to"),
        ("batch.norm_test_form=mine", "batch.norm_test_form"),
        ("batch.norm_test_eta=0", "batch.norm_test_eta"),
        ("gns.small=sample", "gns.small"),
        ("gns.decay=1.0", "gns.decay"),
        ("gns.calibration=-1", "gns.calibration"),
        ("controller.margin=-0.1", "controller.margin"),
        ("checkpoint.keep=0", "checkpoint.keep"),
        ("eval.num_samples=0", "eval.num_samples"),
        ("log.progress=yes", "log.progress"),
    ],
)
def test_bad_value_is_one_line_naming_key_and_value(override, key):
    with pytest.raises(ValueError) as info:
        load_config(None, [override])
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{key}="), msg
    assert "allowed" in msg


def test_value_is_shown_with_repr():
    with pytest.raises(ValueError, match=r"^batch\.policy='adaptive': allowed: one of 'constant'"):
        load_config(None, ["batch.policy=adaptive"])
    with pytest.raises(ValueError, match=r"^train\.lr=-1: "):
        load_config(None, ["train.lr=-1"])


def test_bpe_vocab_must_fit_a_published_model_and_byte_shapes_follow_it():
    """A published shape keeps its vocabulary; the byte-level CPU shapes (vocab 256) grow to the
    tokenizer's (runtime/tokenizer.fit_vocab), so `data.tokenizer=bpe` works with tiny."""
    with pytest.raises(
        ValueError,
        match=r"^data\.bpe_vocab_size=40000: .*vocab_size=32000 of "
        r"model 'tinyllama-1.1b'",
    ):
        load_config(None, ["data.tokenizer=bpe", "data.bpe_vocab_size=40000", "model.name=tinyllama-1.1b"])
    assert load_config(None, ["data.tokenizer=bpe"]).data.bpe_vocab_size == 4096


def test_val_fraction_zero_needs_eval_off():
    with pytest.raises(ValueError, match=r"^data\.val_fraction=0\.0: "):
        load_config(None, ["data.val_fraction=0"])
    cfg = load_config(None, ["data.val_fraction=0", "eval.interval_steps=0"])
    assert cfg.data.val_fraction == 0.0


def test_unknown_section_and_key_list_the_allowed_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config section \[optim\]; allowed: model, data"):
        load_config(None, ["optim.lr=1"])
    with pytest.raises(ValueError, match=r"unknown config key train\.learning_rate; .*lr_schedule"):
        load_config(None, ["train.learning_rate=1"])
    path = tmp_path / "bad.toml"
    path.write_text("[batch]\nmaximum = 3\n")
    with pytest.raises(ValueError, match=r"unknown config key batch\.maximum"):
        load_config(str(path), [])


@pytest.mark.parametrize(
    "override,hint",
    [
        ("train.lr_schedul='cosine'", "did you mean train.lr_schedule?"),  # a typo
        ("batch.maxx=3", "did you mean batch.max?"),
        ("train.nproc=2", "did you mean parallel.nproc?"),  # the right key, wrong section
        ("trian.lr=1", "unknown config section [trian] (did you mean train?)"),
    ],
)
def test_near_miss_keys_get_a_did_you_mean(override, hint):
    with pytest.raises(ValueError) as err:
        load_config(None, [override])
    assert hint in str(err.value) and "\n" not in str(err.value)


def test_far_miss_keys_get_no_guess():
    with pytest.raises(ValueError) as err:
        load_config(None, ["train.zzz=1"])
    assert "did you mean" not in str(err.value)


def test_bad_files_and_override_syntax(tmp_path):
    with pytest.raises(ValueError, match="missing.toml"):
        load_config(str(tmp_path / "missing.toml"), [])
    path = tmp_path / "broken.toml"
    path.write_text("[batch\nmax = 3\n")
    with pytest.raises(ValueError, match="broken.toml.*not valid TOML"):
        load_config(str(path), [])
    for text in ("batchmax=3", "batch.max", ".max=3", "batch.=3", "a.b.c=1"):
        with pytest.raises(ValueError, match="section.key=value"):
            parse_override(text)


def test_override_values_parse_as_toml():
    assert parse_override("batch.max=512") == ("batch", "max", 512)
    assert parse_override("train.lr=3e-4") == ("train", "lr", 3e-4)
    assert parse_override("log.progress=false") == ("log", "progress", False)
    assert parse_override('data.source="a b.txt"') == ("data", "source", "a b.txt")
    assert parse_override("data.source=runs/x.txt.gz") == ("data", "source", "runs/x.txt.gz")


def test_run_length_is_required_for_training():
    with pytest.raises(ValueError, match=r"^train\.max_tokens=0: "):
        check_run_length(load_config(None, []))
    with pytest.raises(ValueError, match=r"lr_schedule='cosine'"):
        check_run_length(load_config(None, ["train.max_steps=10"]))
    check_run_length(load_config(None, ["train.max_steps=10", "train.lr_schedule=constant"]))
    check_run_length(load_config(None, ["train.max_tokens=100000"]))


def test_engine_keys_of_issue_24():
    """AC modes (booleans read as full / none), sequence / loss parallel and compile."""
    from copus.config import load_config

    assert load_config(None).parallel.activation_checkpointing == "none"
    for given, mode in (("selective", "selective"), ("full", "full"), ("false", "none")):
        cfg = load_config(None, [f"parallel.activation_checkpointing={given}"])
        assert cfg.parallel.activation_checkpointing == mode
    cfg = load_config(
        None,
        ["parallel.sequence_parallel=true", "parallel.loss_parallel=false", "train.compile=true", "train.dtype=bf16"],
    )
    assert (cfg.parallel.sequence_parallel, cfg.parallel.loss_parallel) == (True, False)
    assert (cfg.train.compile, cfg.train.dtype) == (True, "bf16")
