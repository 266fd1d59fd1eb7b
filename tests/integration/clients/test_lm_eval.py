"""lm-eval's `local-completions` against `keepwarm serve` equals lm-eval's `hf` model on the same
checkpoint: a local multiple-choice task (per-sample loglikelihoods within 1e-3, same accuracy) and a
`generate_until` task (identical generations). Task YAML and dataset are written here; nothing comes
from the hub (HF_DATASETS_OFFLINE; the `json` builder reads the local file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

MC_DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two makes", "choices": [" four", " seven", " a table"], "answer": 0},
    {"question": "Water is", "choices": [" wet", " dry", " purple and square"], "answer": 0},
    {"question": "A cat says", "choices": [" meow", " moo", " quack quack"], "answer": 0},
]
GEN_DOCS = [{"question": "Once upon a time", "answer": "x"}, {"question": "The weather today", "answer": "y"}]


def _tasks(root: Path) -> Path:
    """Two task YAMLs and their JSON-lines datasets under ``root``."""
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (root / "kw_mc.yaml").write_text(
        f"""task: kw_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
    )
    (root / "kw_gen.yaml").write_text(
        f"""task: kw_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""
    )
    return root


def _evaluate(model: str, model_args: str, tasks_dir: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["kw_mc", "kw_gen"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True,
        batch_size=1,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
    )


def _by_doc(results: dict, task: str) -> dict[int, list]:
    return {s["doc_id"]: s["filtered_resps"] for s in results["samples"][task]}


def test_local_completions_equals_the_hf_model(client_server, tmp_path) -> None:
    tasks_dir = _tasks(tmp_path)
    model_dir = client_server.model_dir
    served = _evaluate(
        "local-completions",
        f"model={client_server.model},base_url={client_server.base_url}/completions,tokenizer={model_dir},"
        "tokenizer_backend=huggingface,add_bos_token=True,num_concurrent=1,max_retries=1,max_length=512",
        tasks_dir,
    )
    reference = _evaluate(
        "hf", f"pretrained={model_dir},dtype=float32,device=cpu,add_bos_token=True", tasks_dir
    )

    ours, theirs = _by_doc(served, "kw_mc"), _by_doc(reference, "kw_mc")
    assert sorted(ours) == sorted(theirs) == list(range(len(MC_DOCS)))
    for doc_id, choices in theirs.items():
        assert len(ours[doc_id]) == len(choices) == 3
        for (ll, greedy), (ref_ll, ref_greedy) in zip(ours[doc_id], choices, strict=True):
            assert ll != 0.0  # a missing prompt logprob would score every choice 0.0
            assert ll == pytest.approx(ref_ll, abs=1e-3) and greedy == ref_greedy
    assert served["results"]["kw_mc"]["acc,none"] == reference["results"]["kw_mc"]["acc,none"]

    generated, expected = _by_doc(served, "kw_gen"), _by_doc(reference, "kw_gen")
    assert generated == expected
    assert all(g and g[0] for g in generated.values())  # something was generated
