"""Run configuration: TOML sections → frozen dataclasses, `--set section.key=value` overrides.

Pure (stdlib only + `copus.core.specs.models`): `copus plan` and `copus simulate` load it without torch.
Keys, defaults and meanings: docs/internals.md "Configuration". Config files are TOML only, so a
config file can never run code. Every user mistake raises `ValueError` with one line:
`<section>.<key>=<value!r>: <what is allowed>`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import tomli_w

from copus.core.plan.layout_map import SYNTAX, LayoutMapError, parse_layout_map
from copus.core.specs.models import MODELS
from copus.core.control.policy_presets import apply_policy_preset

POLICY_NAMES = (
    "constant",
    "ramp",
    "norm-test",
    "norm-test-lau",
    "inner-product-test",
    "gns",
    "goodput",
    "goodput-copus",
    "doubling",
    "schedule",
)

# A check returns None when the value is allowed, else a short "what is allowed" text.
Check = Callable[[Any], str | None]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(lo: int, hi: int | None = None) -> Check:
    text = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    return lambda v: None if _is_int(v) and v >= lo and (hi is None or v <= hi) else text


def _real(lo: float, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False) -> Check:
    """A finite number in the interval; open/closed ends as given."""
    left = "(" if lo_open else "["
    right = ")" if hi_open or hi is None else "]"
    text = f"a number in {left}{lo}, {'inf' if hi is None else hi}{right}"

    def check(v: Any) -> str | None:
        if not _is_real(v):
            return text
        if v < lo or (lo_open and v == lo):
            return text
        if hi is not None and (v > hi or (hi_open and v == hi)):
            return text
        return None

    return check


def _choice(*names: str) -> Check:
    text = "one of " + ", ".join(repr(n) for n in names)
    return lambda v: None if isinstance(v, str) and v in names else text


def _bool() -> Check:
    return lambda v: None if isinstance(v, bool) else "true or false"


def _ac_mode() -> Check:
    """`parallel.activation_checkpointing`: a mode, or a boolean read as "full" / "none"."""
    text = "one of 'none', 'selective', 'full' (or true = 'full', false = 'none')"
    return lambda v: None if isinstance(v, bool) or v in ("none", "selective", "full") else text


def _ac_mode_value(v: Any) -> str:
    return ("full" if v else "none") if isinstance(v, bool) else v


def _nonempty_str() -> Check:
    return lambda v: None if isinstance(v, str) and v.strip() else "a non-empty string"


def _real_or_auto() -> Check:
    """`gns.calibration`: a number > 0 (COPUS: 2.0), "auto" (learnt in the run from the loss
    around batch changes, core.stats.calibration_posterior) or "probe" (measured by branch
    probes, runtime/train/probe.py)."""
    real = _real(0.0, lo_open=True)
    return lambda v: None if v in ("auto", "probe") or real(v) is None else "a number > 0, 'auto' or 'probe'"


def _probe_multipliers() -> Check:
    """`gns.probe_multipliers`: core.critical_batch.parse_probe_multipliers syntax."""
    from copus.core.stats.critical_batch import parse_probe_multipliers

    def check(v: Any) -> str | None:
        try:
            parse_probe_multipliers(v)
        except ValueError:
            return "comma-separated numbers > 0, at least two, including 1 (e.g. '1,2,4')"
        return None

    return check


def _layout_map() -> Check:
    """`parallel.layouts` (core.layout_map syntax); "" = no map."""

    def check(v: Any) -> str | None:
        if not isinstance(v, str):
            return f"a string: {SYNTAX}"
        try:
            parse_layout_map(v)
        except LayoutMapError as err:
            return f"{err.allowed} ({err.problem})"
        return None

    return check


def _tokenizer_setting() -> Check:
    """`data.tokenizer`: 'auto' (a prepared folder's own, else bytes), 'byte', 'bpe' (trained at
    start), a path ending in .json (a Hugging Face tokenizer.json) or a folder holding one (a
    Hugging Face model folder); checked when loaded."""
    text = "'auto', 'byte', 'bpe', a path to a tokenizer.json file or a Hugging Face folder"
    return lambda v: (
        None
        if isinstance(v, str) and (v in ("auto", "byte", "bpe") or v.endswith(".json") or os.path.isdir(v))
        else text
    )


def _opt(default: Any, check: Check, convert: Callable[[Any], Any] | None = None) -> Any:
    """A dataclass field with its default and its validity check (kept in the metadata);
    `convert` maps an allowed value to the stored one (e.g. a legacy boolean to a mode)."""
    return field(default=default, metadata={"check": check, "convert": convert})


_FROZEN = dict(frozen=True, slots=True, kw_only=True)


def _model_name() -> Check:
    """A named shape or a readable Hugging Face config.json (core/specs/hf_config.py)."""

    def check(v: Any) -> str | None:
        if not isinstance(v, str) or not (v in MODELS or v.endswith(".json")):
            return "one of " + ", ".join(repr(n) for n in MODELS) + " or a config.json path"
        if v.endswith(".json"):
            from copus.core.specs.hf_config import load_shape

            try:
                load_shape(v)
            except ValueError as err:
                return str(err)
        return None

    return check


def _hf_folder() -> Check:
    """`model.init_from`: "" (random init) or a Hugging Face folder with config.json."""

    def check(v: Any) -> str | None:
        if v == "":
            return None
        if not isinstance(v, str) or not os.path.isfile(os.path.join(v, "config.json")):
            return "'' or a Hugging Face model folder (config.json + safetensors weights)"
        return None

    return check


@dataclass(**_FROZEN)
class ModelConfig:
    name: str = _opt("tiny", _model_name())
    seq_len: int = _opt(0, _int(0, 1_048_576))  # 0 = the shape's own (2048 for a config.json)
    init_from: str = _opt("", _hf_folder())  # a Hugging Face folder: start from its weights


@dataclass(**_FROZEN)
class DataConfig:
    source: str = _opt("embedded", _nonempty_str())
    tokenizer: str = _opt("auto", _tokenizer_setting())
    bpe_vocab_size: int = _opt(4096, _int(260, 1_000_000))
    val_fraction: float = _opt(0.01, _real(0.0, 0.5))
    max_chars: int = _opt(0, _int(0))


@dataclass(**_FROZEN)
class TrainConfig:
    max_steps: int = _opt(0, _int(0))
    max_tokens: int = _opt(0, _int(0))
    seed: int = _opt(0, _int(0, 2**63 - 1))
    lr: float = _opt(3e-3, _real(0.0, lo_open=True))
    lr_schedule: str = _opt("cosine", _choice("constant", "cosine", "linear"))
    warmup_tokens: int = _opt(0, _int(0))
    min_lr_ratio: float = _opt(0.1, _real(0.0, 1.0))
    lr_rule: str = _opt("sqrt", _choice("none", "linear", "sqrt", "adascale", "sqrt-gain"))
    weight_decay: float = _opt(0.1, _real(0.0))
    beta1: float = _opt(0.9, _real(0.0, 1.0, hi_open=True))
    beta2: float = _opt(0.95, _real(0.0, 1.0, hi_open=True))
    eps: float = _opt(1e-8, _real(0.0, lo_open=True))
    grad_clip: float = _opt(1.0, _real(0.0))
    max_nonfinite_steps: int = _opt(5, _int(1))
    dtype: str = _opt("auto", _choice("auto", "fp32", "bf16"))
    # seconds a collective may wait before the process group aborts (init_process_group's
    # timeout): a rank-0-only step (a checkpoint's hash, a large DCP save) must fit in it
    nccl_timeout_s: float = _opt(1800.0, _real(0.0, lo_open=True))
    compile: bool = _opt(False, _bool())


@dataclass(**_FROZEN)
class ParallelConfig:
    nproc: int = _opt(1, _int(1))
    dp: int = _opt(0, _int(0))
    tp: int = _opt(0, _int(0))
    pp: int = _opt(0, _int(0))
    micro_batch_size: int = _opt(0, _int(0))
    pp_schedule: str = _opt("1f1b", _choice("1f1b", "gpipe"))
    activation_checkpointing: str = _opt("none", _ac_mode(), _ac_mode_value)
    sequence_parallel: bool = _opt(False, _bool())
    loss_parallel: bool = _opt(True, _bool())
    reshard_after_forward: bool = _opt(True, _bool())
    memory_budget_gb: float = _opt(0.0, _real(0.0))
    # share of the device's memory the controller's plans leave free (runtime/train/perf.py)
    memory_margin: float = _opt(0.1, _real(0.0, 1.0, lo_open=True, hi_open=True))
    layouts: str = _opt("", _layout_map())
    backend: str = _opt("auto", _choice("auto", "gloo", "nccl"))


@dataclass(**_FROZEN)
class BatchConfig:
    policy: str = _opt("goodput", _choice(*POLICY_NAMES))
    initial: int = _opt(8, _int(1))
    min: int = _opt(8, _int(1))
    max: int = _opt(256, _int(1))
    max_growth: float = _opt(
        2.0,
        lambda v: (
            None
            if isinstance(v, int | float) and not isinstance(v, bool) and v >= 1
            else "a number >= 1, or inf (no growth cap)"
        ),
    )
    interval_steps: int = _opt(10, _int(1))
    warmup_steps: int = _opt(10, _int(0))
    ramp_kind: str = _opt("linear", _choice("linear", "stepwise"))
    ramp_to: int = _opt(64, _int(1))
    ramp_samples: int = _opt(20000, _int(1))
    ramp_steps: int = _opt(4, _int(1))
    norm_test_eta: float = _opt(0.5, _real(0.0, lo_open=True))
    norm_test_form: str = _opt("per-sample", _choice("per-sample", "micro-batch", "paper"))
    ip_theta: float = _opt(0.5, _real(0.0, lo_open=True))
    orth_nu: float = _opt(5.84, _real(0.0, lo_open=True))
    gns_c: float = _opt(2.0, _real(0.0, lo_open=True))
    # batch.policy = "schedule": "0:768,250B:1536,500B:3072" (token thresholds, K/M/B/T
    # suffixes; batches in schedule_unit; docs/yardstick.md §schedules)
    schedule: str = _opt("", lambda v: None if isinstance(v, str) else "a string such as '0:8,1M:16,4M:32' ('' = none)")
    schedule_unit: str = _opt("samples", _choice("samples", "tokens"))


@dataclass(**_FROZEN)
class GnsConfig:
    small: str = _opt("microbatch", _choice("microbatch", "rank"))
    decay: float = _opt(0.95, _real(0.0, 1.0, lo_open=True, hi_open=True))
    decay_late: float = _opt(0.99, _real(0.0, 1.0, lo_open=True, hi_open=True))
    decay_switch_tokens: int = _opt(8_000_000, _int(0))
    calibration: float | str = _opt("auto", _real_or_auto())
    max_rel_err: float = _opt(0.5, _real(0.0, lo_open=True))
    probe_tokens: int = _opt(16384, _int(1))  # with calibration = "probe"
    probe_interval_tokens: int = _opt(500_000, _int(0))  # 0: only the first probe
    probe_multipliers: str = _opt("1,2,4", _probe_multipliers())
    # "auto": "ema" under the goodput policies (their posterior over c reads a fixed-memory
    # estimator; docs/robust-goodput.md §6.15), "tracking" under every other policy
    estimator: str = _opt("auto", _choice("auto", "tracking", "ema"))
    confidence: float = _opt(1.645, _real(0.0))
    recovery_steps: int = _opt(20, _int(0))


@dataclass(**_FROZEN)
class ControllerConfig:
    margin: float = _opt(0.10, _real(0.0))  # batch.policy = "goodput-copus" only
    lr_aware: bool = _opt(False, _bool())
    # -1 = auto: the direct switch's measured cost model (core.reshard.direct_switch_cost_s)
    reconfig_cost_s: float = _opt(
        -1.0, lambda v: None if _is_real(v) and (v == -1 or v >= 0) else "-1 (auto) or a number >= 0"
    )
    allow_reconfigure: bool = _opt(True, _bool())
    # the goodput run's first plan: "planned" = the controller's fastest plan at batch.initial
    # (its step-time model); "initial" = [parallel] as configured (pure FSDP when unset)
    start: str = _opt("planned", _choice("planned", "initial"))
    switch: str = _opt("in-process", _choice("in-process", "checkpoint"))
    refit_interval_steps: int = _opt(20, _int(1))
    # a `copus profile` profile.json: the goodput controller ranks the plans it measured by
    # their measured step times (core/cost/profile_table.py); "" = the step-time model alone
    profile: str = _opt(
        "", lambda v: None if isinstance(v, str) else "a path to a profile.json from `copus profile`, or ''"
    )


@dataclass(**_FROZEN)
class CheckpointConfig:
    interval_steps: int = _opt(100, _int(0))
    interval_s: float = _opt(0.0, _real(0.0))  # also save when this much wall time passed
    keep: int = _opt(2, _int(1))
    max_failed_saves: int = _opt(3, _int(1))
    background: bool = _opt(False, _bool())  # interval saves written asynchronously (DCP async_save)


@dataclass(**_FROZEN)
class EvalConfig:
    interval_steps: int = _opt(50, _int(0))
    num_samples: int = _opt(64, _int(1))


def _str_list() -> Check:
    return lambda v: (
        None
        if isinstance(v, (list, tuple)) and all(isinstance(x, str) and x for x in v)
        else "a list of non-empty strings, e.g. ['baseline', 'tp2']"
    )


def _any_str() -> Check:
    return lambda v: None if isinstance(v, str) else "a string ('' = the default)"


@dataclass(**_FROZEN)
class LogConfig:
    progress: bool = _opt(True, _bool())
    progress_interval_s: float = _opt(30.0, _real(0.0))  # plain progress line without a tty
    tensorboard: bool = _opt(True, _bool())
    # experiment trackers (runtime/state/trackers.py), optional extras copus[wandb] / copus[mlflow]
    wandb: bool = _opt(False, _bool())
    wandb_project: str = _opt("copus", _nonempty_str())
    wandb_name: str = _opt("", _any_str())  # "" = the run folder's name (W&B and MLflow)
    wandb_tags: tuple[str, ...] = _opt((), _str_list())
    wandb_mode: str = _opt("", _choice("", "online", "offline"))  # "" = WANDB_MODE, else online
    mlflow: str = _opt("", _any_str())  # a tracking URI, e.g. "sqlite:///mlflow.db"; "" = off
    mlflow_experiment: str = _opt("copus", _nonempty_str())


@dataclass(**_FROZEN)
class Config:
    """The whole run configuration, one frozen dataclass per TOML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    gns: GnsConfig = field(default_factory=GnsConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}


def allowed_keys(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def model_shape(cfg: Any):
    """The `ModelShape` a config trains: `model.name` (or config.json) at `model.seq_len`."""
    from copus.core.specs.resolve import get_model_shape

    return get_model_shape(cfg.model.name, cfg.model.seq_len)


def did_you_mean(name: str, allowed: Iterable[str], section: str = "") -> str:
    """' (did you mean X?)' for the closest allowed name (difflib ratio >= 0.6, or a key of
    another section holding `name` exactly), else ''."""
    close = difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.6)
    if close:
        return f" (did you mean {section + '.' if section else ''}{close[0]}?)"
    if section:
        homes = [s for s in SECTIONS if s != section and name in allowed_keys(s)]
        if homes:
            return f" (did you mean {homes[0]}.{name}?)"
    return ""


def _bad(section: str, key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{section}.{key}={value!r}: {allowed}")


def _build_section(section: str, values: Mapping[str, Any]) -> Any:
    """One section from a {key: value} mapping; each value is checked by its field's rule."""
    cls = SECTIONS[section]
    kwargs: dict[str, Any] = {}
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key not in by_name:
            raise ValueError(
                f"unknown config key {section}.{key}{did_you_mean(key, by_name, section)}; "
                f"allowed in [{section}]: {', '.join(by_name)}"
            )
        problem = by_name[key].metadata["check"](value)
        if problem is not None:
            raise _bad(section, key, value, f"allowed: {problem}")
        if by_name[key].type in ("float", "float | str") and not isinstance(value, str):
            value = float(value)
        if by_name[key].metadata.get("convert") is not None:
            value = by_name[key].metadata["convert"](value)
        if isinstance(value, list):
            value = tuple(value)  # frozen sections hold tuples
        kwargs[key] = value
    return cls(**kwargs)


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """A validated `Config` from nested {section: {key: value}}; missing keys take defaults."""
    sections: dict[str, Any] = {}
    data = apply_policy_preset(data)
    for section, values in data.items():
        if section not in SECTIONS:
            raise ValueError(
                f"unknown config section [{section}]{did_you_mean(section, SECTIONS)}; allowed: {', '.join(SECTIONS)}"
            )
        if not isinstance(values, Mapping):
            raise ValueError(f"{section}={values!r}: allowed: a table of keys ({', '.join(allowed_keys(section))})")
        sections[section] = _build_section(section, values)
    cfg = Config(**sections)
    check_consistency(cfg)
    return cfg


def _check_schedule(cfg: Config) -> None:
    """batch.schedule: parsed (one-line error naming the entry), only with batch.policy =
    "schedule", starting at batch.initial, every batch within [batch.min, batch.max]."""
    from copus.core.control.schedules import parse_step_schedule

    b = cfg.batch
    if not b.schedule.strip():
        if b.policy == "schedule":
            raise _bad(
                "batch",
                "schedule",
                b.schedule,
                "allowed: with batch.policy='schedule', a schedule such as '0:8,1M:16,4M:32' (tokens:batch)",
            )
        return
    if b.policy != "schedule":
        raise _bad("batch", "schedule", b.schedule, f"allowed: only with batch.policy='schedule' (got {b.policy!r})")
    sched = parse_step_schedule(b.schedule, unit=b.schedule_unit, seq_len=model_shape(cfg).seq_len)
    if sched.entries[0][1] != b.initial:
        raise _bad(
            "batch",
            "initial",
            b.initial,
            f"allowed: batch.initial = the schedule's first batch {sched.entries[0][1]} ({sched.describe()})",
        )
    for entry, (_, batch) in zip(sched.describe().split(","), sched.entries):
        if not b.min <= batch <= b.max:
            raise ValueError(
                f"batch.schedule entry '{entry}' is invalid: batch {batch} is outside "
                f"[batch.min={b.min}, batch.max={b.max}]; allowed: batches in that range"
            )


def check_consistency(cfg: Config) -> None:
    """Rules that relate keys to each other (each key alone was checked by its field)."""
    b = cfg.batch
    if b.min > b.max:
        raise _bad("batch", "min", b.min, f"allowed: an integer <= batch.max={b.max}")
    if not b.min <= b.initial <= b.max:
        raise _bad("batch", "initial", b.initial, f"allowed: batch.min={b.min} <= batch.initial <= batch.max={b.max}")
    if not b.min <= b.ramp_to <= b.max:
        raise _bad("batch", "ramp_to", b.ramp_to, f"allowed: batch.min={b.min} <= batch.ramp_to <= batch.max={b.max}")
    _check_schedule(cfg)
    vocab = model_shape(cfg).vocab_size  # 256: a byte-level shape follows the tokenizer
    if cfg.data.tokenizer == "bpe" and cfg.data.bpe_vocab_size > vocab != 256:
        raise _bad(
            "data",
            "bpe_vocab_size",
            cfg.data.bpe_vocab_size,
            f"allowed: at most vocab_size={vocab} of model {cfg.model.name!r}",
        )
    _check_init_from(cfg)
    p = cfg.parallel
    if p.layouts.strip():
        fixed = [f"parallel.{k}={getattr(p, k)}" for k in ("dp", "tp", "pp") if getattr(p, k)]
        if fixed:
            raise _bad(
                "parallel",
                "layouts",
                p.layouts,
                f"allowed: a layout map only with parallel.dp/tp/pp unset (got {fixed[0]})",
            )
        if b.policy.startswith("goodput"):
            raise _bad(
                "parallel",
                "layouts",
                p.layouts,
                "allowed: a layout map only with a batch-only policy (batch.policy='goodput' chooses layouts itself)",
            )
    check_norm_test_form(cfg)
    if cfg.eval.interval_steps > 0 and cfg.data.val_fraction == 0:
        raise _bad(
            "data",
            "val_fraction",
            0.0,
            "allowed: a number in (0, 0.5] while eval.interval_steps > 0 (or set eval.interval_steps=0)",
        )


def check_norm_test_form(cfg: Config) -> None:
    """The norm test's "paper" form is over per-worker gradients (gns.small = "rank"), the
    "micro-batch" form over micro-batch ones; `apply_policy_preset` picks gns.small from the
    form unless it was set, so a clash here is the user's explicit choice."""
    form, small = cfg.batch.norm_test_form, cfg.gns.small
    need = {"paper": "rank", "micro-batch": "microbatch"}.get(form)
    if cfg.batch.policy.startswith("norm-test") and need is not None and small != need:
        raise _bad(
            "gns", "small", small, f"allowed: {need!r} with batch.norm_test_form={form!r} (or another norm_test_form)"
        )


def _check_init_from(cfg: Config) -> None:
    """`model.init_from`'s config.json must describe the shape copus builds (`model.name`)."""
    if not cfg.model.init_from:
        return
    from copus.core.specs.resolve import get_model_shape

    theirs = get_model_shape(os.path.join(cfg.model.init_from, "config.json"), cfg.model.seq_len)
    ours = model_shape(cfg)
    for f in dataclasses.fields(ours):
        if f.name != "name" and getattr(ours, f.name) != getattr(theirs, f.name):
            raise _bad(
                "model",
                "init_from",
                cfg.model.init_from,
                f"allowed: a folder whose config.json has {f.name}={getattr(ours, f.name)!r} like "
                f"model.name={cfg.model.name!r} (it has {getattr(theirs, f.name)!r})",
            )


def check_run_length(cfg: Config) -> None:
    """A training run needs an end: train.max_steps > 0 or train.max_tokens > 0.

    Not part of `load_config` (planning and simulation need no run length); `copus train` calls it.
    A decaying LR schedule (cosine, linear) decays over max_tokens, so it needs max_tokens > 0.
    """
    t = cfg.train
    if t.max_steps == 0 and t.max_tokens == 0:
        raise _bad("train", "max_tokens", 0, "allowed: an integer > 0 when train.max_steps=0 (set one of them)")
    if t.lr_schedule != "constant" and t.max_tokens == 0:
        raise _bad(
            "train",
            "max_tokens",
            0,
            f"allowed: an integer > 0 with train.lr_schedule={t.lr_schedule!r} "
            "(it decays over max_tokens), or train.lr_schedule='constant'",
        )


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` → (section, key, value); value parsed as TOML, else a bare string."""
    name, sep, raw = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key or "." in key:
        raise ValueError(f"--set {text!r}: allowed: section.key=value, e.g. batch.max=512")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def apply_overrides(data: dict[str, dict[str, Any]], overrides: Iterable[str]) -> None:
    for text in overrides:
        section, key, value = parse_override(text)
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ValueError(f"{section}={data[section]!r}: allowed: a table")
        data[section][key] = value


def load_config(path: str | None = None, overrides: Iterable[str] = ()) -> Config:
    """Defaults ← TOML file at `path` (if any) ← each `section.key=value` override, validated."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ValueError(f"config file {path!r} cannot be read: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {path!r} is not valid TOML: {exc}") from None
    apply_overrides(data, overrides)
    return config_from_dict(data)


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}


def config_to_toml(cfg: Config) -> str:
    """Every key written out, so a run folder's config.toml reproduces the run exactly."""
    return tomli_w.dumps(config_to_dict(cfg))
