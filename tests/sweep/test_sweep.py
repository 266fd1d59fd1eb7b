"""The sweep's own parts (fast, in `make test`) and the whole sweep (marker `sweep`, `make sweep`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.sweep import architectures_page, run
from tests.sweep.shrink import WINDOW, shrink_dict, tiny_config


def test_shrink_keeps_every_layer_kind_and_the_window() -> None:
    default = {
        "model_type": "x",
        "hidden_size": 4096,
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "no_rope_layers": [1, 1, 1, 0, 1, 1],
        "sliding_window": 4096,
        "head_dim": None,
        "q_lora_rank": None,
        "eos_token_id": [200002, 199999],
        "text_config": {"model_type": "y", "hidden_size": 1024, "num_hidden_layers": 3},
    }
    shrunk = shrink_dict(default)
    assert shrunk["layer_types"] == ["sliding_attention", "full_attention"]
    assert shrunk["num_hidden_layers"] == 2 and shrunk["no_rope_layers"] == [1, 1]
    assert shrunk["sliding_window"] == WINDOW and shrunk["hidden_size"] == 64
    assert shrunk["head_dim"] == 16 and shrunk["q_lora_rank"] is None  # None: this model has no q LoRA
    assert shrunk["eos_token_id"] == 2  # the shared tokenizer's EOS
    assert shrunk["text_config"]["hidden_size"] == 64 and shrunk["text_config"]["num_hidden_layers"] == 2


def test_tiny_config_passes_transformers_validators() -> None:
    config = tiny_config("gemma2")
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert (config.hidden_size, config.sliding_window) == (64, WINDOW)


def test_page_block_groups_reasons_and_replaces_only_its_section() -> None:
    report = {
        "transformers": "5.0",
        "torch": "2.0",
        "summary": {"identical": 1, "refused": 2, "not_judged": 0, "different": 0, "error": 0},
        "types": {
            "llama": {"verdict": "identical", "reason": ""},
            "bert": {"verdict": "refused", "reason": "AttentionFusionError: BertSelfAttention is not causal"},
            "roberta": {"verdict": "refused", "reason": "AttentionFusionError: RobertaSelf is not causal"},
        },
    }
    block = architectures_page.render(report)
    assert "**1 identical, 2 refused up front" in block
    assert (
        "- Refused, non-causal attention modules (cross-attention of encoder-decoder models, "
        "encoders) (2): bert, roberta." in block
    )
    text = f"before\n{architectures_page.BEGIN}\nold\n{architectures_page.END}\nafter\n"
    assert architectures_page.update(text, block) == f"before\n{block}\nafter\n"
    with pytest.raises(ValueError, match="no"):
        architectures_page.update("no markers here", block)


def test_the_architectures_page_is_the_committed_report() -> None:
    """docs/reference/architectures.md says what tests/sweep/report.json says (`make sweep` writes both)."""
    root = Path(__file__).resolve().parents[2]
    report = json.loads((root / "tests" / "sweep" / "report.json").read_text())
    page = (root / "docs" / "reference" / "architectures.md").read_text()
    assert architectures_page.update(page, architectures_page.render(report)) == page, (
        "docs/reference/architectures.md drifted from tests/sweep/report.json: run "
        "python -m tests.sweep.architectures_page tests/sweep/report.json docs/reference/architectures.md"
    )


@pytest.mark.sweep
def test_every_causal_lm_type_is_identical_refused_or_not_judged(tmp_path) -> None:
    report = tmp_path / "report.json"
    status = run.main(["--report", str(report)])
    counts = json.loads(report.read_text())["summary"]
    assert status == 0 and counts["different"] == 0 and counts["error"] == 0, counts
