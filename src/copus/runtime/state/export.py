"""`copus export`: a DCP checkpoint (any dp/tp/pp layout) → a Hugging Face Llama folder.

Output: `model.safetensors` (or `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`
when larger than `max_shard_bytes`), `config.json` (LlamaForCausalLM), and the run's
`tokenizer.json` + `tokenizer_config.json` when it has one (the byte tokenizer has none).

Gathering: DCP stores each tensor's global shape and reshards on load, so loading into full-size
CPU tensors in one process (`no_dist`) reassembles FSDP / TP shards and pipeline stages alike.

Name and layout mapping (copus runtime/engine/model.py ↔ transformers' modeling_llama):

    tok_embeddings.weight                 model.embed_tokens.weight
    layers.i.attention.w{q,k,v,o}.weight  model.layers.i.self_attn.{q,k,v,o}_proj.weight
    layers.i.feed_forward.w1 / w3 / w2    model.layers.i.mlp.gate_proj / up_proj / down_proj
    layers.i.attention_norm / ffn_norm    model.layers.i.input_layernorm / post_attention_layernorm
    norm.weight / output.weight           model.norm.weight / lm_head.weight (absent when tied)

Everything else already agrees: RMSNorm y = x·rsqrt(mean(x²) + eps)·w in fp32 with the same eps,
SwiGLU w2(silu(w1 x)·w3 x), GQA by repeating each kv head over consecutive query heads,
frequencies θ^(−2i/d), scale 1/√d. The one difference is RoPE's pairing: copus rotates
consecutive pairs (x_{2i}, x_{2i+1}) (Su et al.; Meta's Llama code), transformers rotates halves
(x_i, x_{i+d/2}). Permuting the rows of wq and wk inside each head — HF row j < d/2 takes copus
row 2j, row d/2 + j takes row 2j + 1 — maps one onto the other exactly (q·k per head is
unchanged because q and k are permuted alike); this is the permutation of transformers'
`convert_llama_weights_to_hf.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from copus.core.specs.models import ModelShape

from copus.core.specs.resolve import get_model_shape
from copus.runtime.state import checkpoint as ckpt

MAX_SHARD_BYTES = 5 * 2**30
_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """`run_dir/checkpoints/step-N` (verified), the latest good one when `step` is None."""
    root = run_dir / "checkpoints"
    if not run_dir.is_dir():
        raise ValueError(f"RUN_DIR={str(run_dir)!r}: no such folder; allowed: a copus run folder")
    if step is None:
        path = ckpt.find_latest(root, log=lambda _: None) if root.is_dir() else None
        if path is None:
            raise ValueError(f"RUN_DIR={str(run_dir)!r}: has no valid checkpoint; allowed: a run "
                             "folder with checkpoints/step-N")
        return path
    path = root / f"step-{step}"
    steps = [s for s, _ in ckpt.step_dirs(root)] if root.is_dir() else []
    if not path.is_dir():
        raise ValueError(f"--step={step}: no checkpoint step-{step} in {root}; allowed: "
                         f"{', '.join(map(str, steps)) or 'none'}")
    problem = ckpt.verify(path)
    if problem is not None:
        raise ValueError(f"--step={step}: {problem}")
    return path


def load_full_model_state(path: Path) -> dict[str, torch.Tensor]:
    """All model tensors of a checkpoint, full size, on CPU (DCP reassembles every shard)."""
    meta = ckpt.read_metadata(path)
    sd = {}
    for key, item in meta.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(item, "size"):
            sd[key[len("model."):]] = torch.empty(item.size, dtype=item.properties.dtype)
    if "tok_embeddings.weight" not in sd:
        raise ValueError(f"{path}: holds no model tensors (tok_embeddings.weight missing)")
    with warnings.catch_warnings():   # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        ckpt.load(path, {"model": sd}, check=False)
    return sd


def _permute_rope(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head from consecutive-pair order to half-split order (see module doc)."""
    out_dim, in_dim = w.shape
    heads = out_dim // head_dim
    return w.view(heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def to_hf_state(sd: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """copus names/layouts → transformers Llama names/layouts (contiguous tensors)."""
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"],
           "model.norm.weight": sd["norm.weight"]}
    if not shape.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    for i in range(shape.n_layers):
        for src, dst in _LAYER_MAP.items():
            w = sd[f"layers.{i}.{src}"]
            if src in ("attention.wq.weight", "attention.wk.weight"):
                w = _permute_rope(w, shape.head_dim)
            out[f"model.layers.{i}.{dst}"] = w
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(shape: ModelShape, dtype: torch.dtype, eos_id: int | None) -> dict:
    """config.json of a LlamaForCausalLM with copus's shape."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": shape.dim, "intermediate_size": shape.ffn_dim,
        "num_hidden_layers": shape.n_layers, "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads, "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size, "max_position_embeddings": shape.seq_len,
        "rms_norm_eps": shape.norm_eps, "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "rope_scaling": None, "tie_word_embeddings": shape.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _write_safetensors(out: Path, state: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ValueError("copus export needs the safetensors package (pip install "
                         "'copus[export]')") from None

    sizes = {k: v.numel() * v.element_size() for k, v in state.items()}
    total = sum(sizes.values())
    if total <= max_shard_bytes:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    groups: list[list[str]] = [[]]
    used = 0
    for k in state:
        if groups[-1] and used + sizes[k] > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(k)
        used += sizes[k]
    weight_map = {}
    for n, keys in enumerate(groups, start=1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: state[k] for k in keys}, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out={str(out)!r}: exists and is not an empty folder; allowed: a new "
                         "or empty folder")


def export(run_dir: str | Path, out: str | Path, *, step: int | None = None,
           max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write the Hugging Face folder `out` from `run_dir`'s checkpoint; return the checkpoint
    used. Written into `.<out>.partial` and renamed, so `out` is complete or absent."""
    run_dir, out = Path(run_dir).expanduser(), Path(out).expanduser()
    _check_out(out)
    path = find_checkpoint(run_dir, step)
    state = json.loads((path / ckpt.TRAINER_STATE).read_text())
    sd = load_full_model_state(path)
    shape = dataclasses.replace(get_model_shape(state["model"]),
                                vocab_size=int(sd["tok_embeddings.weight"].shape[0]))
    tok_file = run_dir / "tokenizer.json"
    eos_id = None
    if tok_file.is_file():
        from copus.runtime.data.tokenizer import HfTokenizer

        eos_id = HfTokenizer.from_file(tok_file).eos_id
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        _write_safetensors(partial, to_hf_state(sd, shape), max_shard_bytes)
        config = hf_config(shape, sd["tok_embeddings.weight"].dtype, eos_id)
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tok_file.is_file():
            shutil.copyfile(tok_file, partial / "tokenizer.json")
            tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast",
                       "model_max_length": shape.seq_len}
            if eos_id is not None:
                from tokenizers import Tokenizer

                tok_cfg["eos_token"] = Tokenizer.from_file(str(tok_file)).id_to_token(eos_id)
            (partial / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        for f in partial.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out.is_dir():
            out.rmdir()
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return path
