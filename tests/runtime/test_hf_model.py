"""`train --model config.json`: the runtime builds exactly the shape a tiny config.json describes."""

import json

import torch

from copus.core.specs.resolve import get_model_shape
from copus.runtime.engine.model import build_model, materialize


def test_runtime_builds_the_config_json_shape(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "num_hidden_layers": 3,
                "hidden_size": 48,
                "num_attention_heads": 6,
                "num_key_value_heads": 2,
                "intermediate_size": 80,
                "vocab_size": 128,
                "tie_word_embeddings": True,
            }
        )
    )
    shape = get_model_shape(str(path), 32)
    model = materialize(build_model(shape, "cpu"), "cpu", seed=0)
    assert sum(p.numel() for p in model.parameters()) == shape.num_params()
    assert len(model.layers) == 3
    logits = model(torch.randint(0, 128, (2, 32)))
    assert logits.shape == (2, 32, 128)
