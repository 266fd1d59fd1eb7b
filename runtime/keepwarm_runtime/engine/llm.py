"""LLM: the offline API, shaped like vLLM's so switching is an import change.

from keepwarm_runtime import LLM, SamplingParams
llm = LLM("/models/tiny")
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
outputs = llm.chat([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from keepwarm_runtime.engine.chat import render_chat
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.llm_engine import LLMEngine
from keepwarm_runtime.engine.outputs import RequestOutput
from keepwarm_runtime.engine.sampling_params import SamplingParams

Prompt = str | dict[str, Any]  # text, {"prompt": text} or {"prompt_token_ids": [...]}
Messages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str, **engine_kwargs: Any):
        """`engine_kwargs` are EngineConfig fields: dtype, device, max_num_seqs, block_size, ..."""
        self.engine = LLMEngine(EngineConfig(model_dir=str(model), **engine_kwargs))
        self._ids = itertools.count()
        self._pending: list[str] = []  # enqueued request ids, in order

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        self.enqueue(prompts, sampling_params)
        return self.wait_for_completion()

    def chat(
        self,
        messages: Messages | Seq[Messages],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        self.enqueue_chat(
            messages,
            sampling_params,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            tokenization_kwargs=tokenization_kwargs,
        )
        return self.wait_for_completion()

    def enqueue(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[str]:
        """Queue prompts without running them; `wait_for_completion()` runs everything queued."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        return [
            self._add(*self._encode(p), params)
            for p, params in zip(prompts, _per_prompt(sampling_params, len(prompts)), strict=True)
        ]

    def enqueue_chat(
        self,
        messages: Messages | Seq[Messages],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        ids = []
        for conversation, params in zip(
            conversations, _per_prompt(sampling_params, len(conversations)), strict=True
        ):
            tokens = render_chat(
                self.engine.tokenizer,
                conversation,
                add_generation_prompt=add_generation_prompt,
                tokenization_kwargs=tokenization_kwargs,
                chat_template_kwargs=chat_template_kwargs,
            )
            ids.append(self._add(None, tokens, params))
        return ids

    def wait_for_completion(self) -> list[RequestOutput]:
        """Run until every queued request finishes; outputs in the order they were queued."""
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        pending, self._pending = self._pending, []
        return [finished[rid] for rid in pending if rid in finished]

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.engine.tokenizer(prompt)["input_ids"])
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        return self._encode(prompt["prompt"])

    def _add(self, text: str | None, tokens: list[int], params: SamplingParams) -> str:
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, tokens, params, prompt=text)
        self._pending.append(request_id)
        return request_id


def _per_prompt(params: SamplingParams | Seq[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
