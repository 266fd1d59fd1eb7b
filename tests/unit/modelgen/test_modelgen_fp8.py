"""`keepwarm make-model --fp8` writes the FP8 checkpoint layout transformers and keepwarm read."""

from __future__ import annotations

import json
import subprocess
import sys

from safetensors import safe_open


def test_make_model_fp8(tmp_path) -> None:
    out = tmp_path / "m"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "keepwarm_runtime.cli",
            "make-model",
            str(out),
            "--arch",
            "qwen3_moe",
            "--params",
            "400K",
            "--vocab-size",
            "512",
            "--fp8",
        ],
        check=True,
        capture_output=True,
    )
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    dtypes = {}
    for name, shard in index.items():
        with safe_open(out / shard, "pt") as f:
            dtypes[name] = f.get_slice(name).get_dtype()
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.0.self_attn.q_proj.weight_scale_inv"] == "F32"
    assert dtypes["model.layers.0.mlp.experts.3.down_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.0.mlp.gate.weight"] != "F8_E4M3"  # the router stays in float
    assert dtypes["lm_head.weight"] != "F8_E4M3" and dtypes["model.embed_tokens.weight"] != "F8_E4M3"
    assert not any(n.startswith("model.norm") and d == "F8_E4M3" for n, d in dtypes.items())
