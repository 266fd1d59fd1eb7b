"""The CPU twin of the FlashInfer backend's build(): the runner's host lists make its page table."""

from __future__ import annotations

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.engine.attention.page_table import page_table


def test_every_pass_of_a_real_engine_gives_flashinfer_a_page_table(make_tiny) -> None:
    """The CPU twin of the FlashInfer backend's build(): the runner's host lists, for every pass of a
    chunked, mixed prefill/decode batch, make the page table FlashInfer plans from (the runner once
    left block_tables_list empty, which failed only on a GPU)."""
    llm = LLM(make_tiny("llama"), dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    backend = llm.engine.runner.backend()
    seen = []

    def build(meta):
        table = page_table(meta.context_lens_list, meta.block_tables_list, meta.block_size)
        assert meta.block_tables_list == [
            row[: len(blocks)]
            for row, blocks in zip(meta.block_tables.tolist(), meta.block_tables_list, strict=True)
        ]
        seen.append((meta.prefill_only, len(table.last_page_len)))
        return original(meta)

    original, backend.build = backend.build, build
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4)
    llm.generate([{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 21)], params)
    assert any(prefill for prefill, _ in seen) and any(not prefill for prefill, _ in seen)
    assert max(batch for _, batch in seen) == 3
