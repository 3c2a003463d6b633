"""Hugging Face config.json → ModelShape: good files, every bad field named in one line, CLIs."""

import json

import pytest

from copus.cli import main
from copus.config import load_config, model_shape
from copus.core.specs.hf_config import load_shape, shape_from_dict
from copus.core.specs.resolve import get_model_shape

# transformers' config.json of meta-llama/Llama-3.2-3B (the fields copus reads, as published)
LLAMA_32_3B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "num_hidden_layers": 28, "hidden_size": 3072, "num_attention_heads": 24,
               "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
               "tie_word_embeddings": True, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
               "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}


def _write(tmp_path, data, name="config.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_llama_config_gives_the_named_shape(tmp_path):
    shape = load_shape(_write(tmp_path, LLAMA_32_3B))
    named = get_model_shape("llama-3.2-3b")
    for f in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len",
              "tie_embeddings", "rope_theta", "norm_eps"):
        assert getattr(shape, f) == getattr(named, f), f
    assert shape.num_params() == named.num_params()          # 3.21e9, as published


def test_defaults_and_seq_len(tmp_path):
    data = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    shape = load_shape(_write(tmp_path, data), seq_len=96)
    assert shape.n_kv_heads == shape.n_heads == 4           # multi-head attention by default
    assert not shape.tie_embeddings and shape.seq_len == 96
    assert get_model_shape(_write(tmp_path, TINY)).seq_len == 2048   # COPUS's default
    assert get_model_shape("tiny", 512).seq_len == 512       # named shapes take --seq-len too


@pytest.mark.parametrize("change,field", [
    ({"num_hidden_layers": None}, "'num_hidden_layers' is missing"),
    ({"hidden_size": None}, "'hidden_size' is missing"),
    ({"intermediate_size": "128"}, "intermediate_size='128'"),
    ({"vocab_size": 0}, "vocab_size=0"),
    ({"num_attention_heads": True}, "num_attention_heads=True"),
    ({"hidden_size": 66}, "hidden_size=66"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes'"),
    ({"rope_theta": -1}, "rope_theta=-1"),
])
def test_bad_field_is_named(change, field):
    data = {**TINY, **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ValueError) as err:
        shape_from_dict(data, name="x")
    assert field in str(err.value) and "\n" not in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="not valid JSON"):
        load_shape(_write(tmp_path, "{\"num_hidden_layers\": 2,"))
    with pytest.raises(ValueError, match="top level is list"):
        load_shape(_write(tmp_path, [1, 2]))
    with pytest.raises(ValueError, match="cannot be read"):
        load_shape(str(tmp_path / "absent.json"))


def test_plan_and_simulate_accept_config_json(tmp_path, capsys):
    path = _write(tmp_path, TINY)
    assert main(["plan", "--model", path, "--gpus", "2", "--hardware", "cpu", "--seq-len", "64",
                 "--json", "--top", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 and rows[0]["dp"] * rows[0]["tp"] * rows[0]["pp"] == 2
    # a longer sequence is slower per step: the shape really carries --seq-len
    assert main(["plan", "--model", path, "--gpus", "2", "--hardware", "cpu", "--seq-len", "256",
                 "--json", "--top", "1", "--micro-batch-sizes", str(rows[0]["micro_batch_size"])]) == 0
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
