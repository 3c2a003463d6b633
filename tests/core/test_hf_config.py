"""Hugging Face config.json → ModelShape: good files, every bad field named in one line, CLIs."""

import json

import pytest

from copus.cli import main
from copus.config import load_config, model_shape
from copus.core.specs.hf_config import load_shape, shape_from_dict
from copus.core.specs.resolve import get_model_shape

# transformers' config.json of meta-llama/Llama-3.2-3B (the fields copus reads, as published)
LLAMA_32_3B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 28,
    "hidden_size": 3072,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
}


def _write(tmp_path, data, name="config.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_llama_config_gives_the_named_shape(tmp_path):
    shape = load_shape(_write(tmp_path, LLAMA_32_3B))
    named = get_model_shape("llama-3.2-3b")
    for f in (
        "n_layers",
        "dim",
        "n_heads",
        "n_kv_heads",
        "ffn_dim",
        "vocab_size",
        "seq_len",
        "tie_embeddings",
        "rope_theta",
        "norm_eps",
    ):
        assert getattr(shape, f) == getattr(named, f), f
    assert shape.num_params() == named.num_params()  # 3.21e9, as published


def test_defaults_and_seq_len(tmp_path):
    data = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    shape = load_shape(_write(tmp_path, data), seq_len=96)
    assert shape.n_kv_heads == shape.n_heads == 4  # multi-head attention by default
    assert not shape.tie_embeddings and shape.seq_len == 96
    assert get_model_shape(_write(tmp_path, TINY)).seq_len == 2048  # COPUS's default
    assert get_model_shape("tiny", 512).seq_len == 512  # named shapes take --seq-len too


@pytest.mark.parametrize(
    "change,field",
    [
        ({"num_hidden_layers": None}, "'num_hidden_layers' is missing"),
        ({"hidden_size": None}, "'hidden_size' is missing"),
        ({"intermediate_size": "128"}, "intermediate_size='128'"),
        ({"vocab_size": 0}, "vocab_size=0"),
        ({"num_attention_heads": True}, "num_attention_heads=True"),
        ({"hidden_size": 66}, "hidden_size=66"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes'"),
        ({"rope_theta": -1}, "rope_theta=-1"),
    ],
)
def test_bad_field_is_named(change, field):
    data = {**TINY, **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ValueError) as err:
        shape_from_dict(data, name="x")
    assert field in str(err.value) and "\n" not in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="not valid JSON"):
        load_shape(_write(tmp_path, '{"num_hidden_layers": 2,'))
    with pytest.raises(ValueError, match="top level is list"):
        load_shape(_write(tmp_path, [1, 2]))
    with pytest.raises(ValueError, match="cannot be read"):
        load_shape(str(tmp_path / "absent.json"))


def test_plan_and_simulate_accept_config_json(tmp_path, capsys):
    path = _write(tmp_path, TINY)
    assert (
        main(["plan", "--model", path, "--gpus", "2", "--hardware", "cpu", "--seq-len", "64", "--json", "--top", "3"])
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 and rows[0]["dp"] * rows[0]["tp"] * rows[0]["pp"] == 2
    # a longer sequence is slower per step: the shape really carries --seq-len
    assert (
        main(
            [
                "plan",
                "--model",
                path,
                "--gpus",
                "2",
                "--hardware",
                "cpu",
                "--seq-len",
                "256",
                "--json",
                "--top",
                "1",
                "--micro-batch-sizes",
                str(rows[0]["micro_batch_size"]),
            ]
        )
        == 0
    )
    longer = json.loads(capsys.readouterr().out)
    assert longer[0]["step_s"] > rows[0]["step_s"]


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_bad_config_json_exits_2_with_one_line(tmp_path, capsys, command):
    path = _write(tmp_path, {**TINY, "hidden_size": "big"})
    assert main([command, "--model", path, "--gpus", "2", "--hardware", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "hidden_size='big'" in err and len(err.splitlines()) == 1


def test_train_config_validates_the_file(tmp_path):
    path = _write(tmp_path, TINY)
    cfg = load_config(None, [f'model.name="{path}"', "model.seq_len=64"])
    assert model_shape(cfg).dim == 64 and model_shape(cfg).seq_len == 64
    bad = _write(tmp_path, {**TINY, "vocab_size": -5}, "bad.json")
    with pytest.raises(ValueError, match="vocab_size=-5"):
        load_config(None, [f'model.name="{bad}"'])


# transformers' config.json of Qwen/Qwen3-0.6B (the fields that matter): explicit head_dim, QK-norm
QWEN3 = {**TINY, "model_type": "qwen3", "head_dim": 128, "architectures": ["Qwen3ForCausalLM"]}
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"model_type": "gpt2"}, "model_type='gpt2' is invalid; allowed: llama, mistral, qwen2, qwen3"),
        ({"model_type": "mixtral", "num_local_experts": 8}, "mixture-of-experts"),
        ({"num_local_experts": 8}, "num_local_experts=8: a mixture-of-experts model"),
        ({"model_type": "qwen2", "moe_intermediate_size": 64}, "moe_intermediate_size=64"),
        ({"rope_scaling": {**LLAMA31_ROPE, "factor": None}}, "factor=None is invalid"),
        ({"head_dim": 15}, "head_dim=15 is invalid; allowed: an even integer"),
        ({"attention_bias": "yes"}, "attention_bias='yes' is invalid"),
    ],
)
def test_configs_copus_cannot_price_or_read_are_refused_in_one_line(change, needle):
    with pytest.raises(ValueError) as err:
        shape_from_dict({**TINY, **change}, name="x")
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"model_type": "qwen3", "head_dim": 128}, "model_type='qwen3' is not supported by copus's model (QK-norm)"),
        (
            {"model_type": "mistral", "sliding_window": 1024},
            "sliding_window=1024 is not supported by copus's model (a window shorter than seq_len=2048)",
        ),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 512}, "sliding_window=512"),
        ({"use_qk_norm": True}, "use_qk_norm=True is not supported by copus's model (QK-norm)"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn' is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type='dynamic'"),
        ({"mlp_bias": True}, "mlp_bias=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
    ],
)
def test_fields_the_model_cannot_represent_are_priced_but_not_built(change, needle):
    """The planner prices these (FLOPs and memory hold); copus's model refuses them in one line."""
    shape = shape_from_dict({**TINY, **change}, name="x")
    assert needle in shape.unsupported and "\n" not in shape.unsupported
    from copus.runtime.engine.model import build_model

    with pytest.raises(ValueError) as err:
        build_model(shape, "meta")
    assert str(err.value) == shape.unsupported
    assert shape_from_dict(TINY, name="x").unsupported == ""


def test_qwen3_is_planned_but_training_it_exits_2_naming_the_field(tmp_path, capsys):
    path = _write(tmp_path, QWEN3)
    assert main(["plan", "--model", path, "--gpus", "2", "--hardware", "cpu", "--top", "1"]) == 0
    capsys.readouterr()
    assert main(["train", "--model", path, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type='qwen3'" in err[0] and "QK-norm" in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "change,expect",
    [
        ({"head_dim": 24}, {"head_dim": 24, "explicit_head_dim": 24}),
        ({"head_dim": 16}, {"head_dim": 16, "explicit_head_dim": None}),  # = hidden / heads
        ({"head_dim": 24, "hidden_size": 66}, {"head_dim": 24, "dim": 66}),  # not a multiple: fine
        ({"attention_bias": True}, {"qkv_bias": True, "o_bias": True}),
        ({"model_type": "qwen2"}, {"qkv_bias": True, "o_bias": False}),
        ({"rope_scaling": LLAMA31_ROPE, "rope_theta": 5e5}, {"rope_theta": 5e5}),
        ({"rope_parameters": {**LLAMA31_ROPE, "rope_theta": 5e5}}, {"rope_theta": 5e5}),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, {"rope_theta": 1e6, "rope_scaling": None}),
        ({"model_type": "mistral", "sliding_window": 4096}, {"n_layers": 2}),  # window >= seq_len
        ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 512}, {"n_layers": 2}),
    ],
)
def test_representable_fields_are_honoured(change, expect):
    shape = shape_from_dict({**TINY, **change}, name="x")
    for key, value in expect.items():
        assert getattr(shape, key) == value, key
    if "rope_type" in str(change) and "llama3" in str(change):
        assert shape.rope_scaling.factor == 8.0 and shape.rope_scaling.original_max_position_embeddings == 8192


def test_param_count_follows_head_dim_and_biases():
    plain = shape_from_dict(TINY, name="x")
    wide = shape_from_dict({**TINY, "head_dim": 32, "model_type": "qwen2"}, name="x")
    q, kv = 4 * 32, 2 * 32
    per_layer = plain.layer_params() + 2 * 64 * (q - 64) + 2 * 64 * (kv - 32) + q + 2 * kv
    assert wide.layer_params() == per_layer
