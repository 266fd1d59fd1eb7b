"""LLM: the offline API, shaped like vLLM's so switching is an import change.

from keepwarm_runtime import LLM, SamplingParams
llm = LLM("/models/tiny")
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
outputs = llm.chat([{"role": "user", "content": "Hi"}])

llm = LLM("/models/tiny", enable_lora=True)
outputs = llm.generate(["Hello"], lora_request=LoRARequest("sql", 1, "/adapters/sql"))

llm = LLM("/models/tiny", tensor_parallel_size=2)  # this process is rank 0; ranks 1.. are its children
llm.close()  # stops them (also done when the LLM is garbage collected, or at exit)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from keepwarm_runtime.engine.chat import render_chat
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.llm_engine import LLMEngine
from keepwarm_runtime.engine.outputs import RequestOutput
from keepwarm_runtime.engine.parallel import group as parallel_group
from keepwarm_runtime.engine.parallel import launch
from keepwarm_runtime.engine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | dict[str, Any]  # text, {"prompt": text} or {"prompt_token_ids": [...]}
Messages = list[dict[str, Any]]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: a PEFT adapter by name and path, registered with the engine on first use. keepwarm
    keys adapters by name; ``lora_int_id`` is accepted for vLLM's signature and not used."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class LLM:
    def __init__(self, model: str, **engine_kwargs: Any):
        """`engine_kwargs` are EngineConfig fields: dtype, device, max_num_seqs, block_size, ...;
        with ``tensor_parallel_size`` N > 1 this process is rank 0 and starts ranks 1..N-1
        (engine/parallel/launch.py), which ``close()`` stops."""
        config = EngineConfig(model_dir=str(model), **engine_kwargs)
        self._close = lambda: None
        if config.tensor_parallel_size > 1:
            launch.refuse_unsplittable(config)
            ranks = launch.RankProcesses(config)
            threads = torch.get_num_threads() if config.device == "cpu" else None  # restored by close()
            if threads is not None:
                launch.share_threads(config.tensor_parallel_size)
            try:
                self.engine = LLMEngine(ranks.config)
            except BaseException:
                _stop_group(None, ranks)
                raise
            self._close = weakref.finalize(self, _stop_group, self.engine.runner, ranks, threads)
        else:
            self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._pending: list[str] = []  # enqueued request ids, in order

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel group (a no-op for one process); the LLM serves
        nothing after."""
        self._close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or one (or None: the base) per prompt."""
        self.enqueue(prompts, sampling_params, lora_request)
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
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[str]:
        """Queue prompts without running them; `wait_for_completion()` runs everything queued."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        loras = self._loras(lora_request, len(prompts))
        return [
            self._add(*self._encode(p), params, lora)
            for p, params, lora in zip(
                prompts, _per_prompt(sampling_params, len(prompts)), loras, strict=True
            )
        ]

    def _loras(self, request: LoRARequest | Seq[LoRARequest | None] | None, count: int) -> list[str | None]:
        """Adapter names per prompt, registering each adapter the engine does not know yet."""
        requests = [request] * count if request is None or isinstance(request, LoRARequest) else list(request)
        if len(requests) != count:
            raise ValueError(f"got {len(requests)} LoRA requests for {count} prompts")
        for lora in requests:
            if lora is not None and lora.lora_name not in self.engine.lora_names():
                self.engine.add_lora(lora.lora_name, lora.lora_path)
        return [None if lora is None else lora.lora_name for lora in requests]

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

    def _add(
        self, text: str | None, tokens: list[int], params: SamplingParams, lora: str | None = None
    ) -> str:
        request_id = str(next(self._ids))
        # Only its last output is read (wait_for_completion): none is built on the steps before.
        final_only = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        self.engine.add_request(request_id, tokens, final_only, prompt=text, lora_name=lora)
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


def _stop_group(runner, ranks: launch.RankProcesses, threads: int | None = None) -> None:
    """Tell ranks 1..N-1 to stop (when rank 0's runner can still reach them), reap them, leave."""
    told = False
    if runner is not None:
        try:
            runner.channel.stop()
            told = True
        except Exception:  # a rank already gone: the group is broken; kill the rest
            log.warning("the tensor-parallel ranks could not be told to stop; killing them")
    ranks.stop(told)
    parallel_group.leave()
    if threads is not None:
        torch.set_num_threads(threads)
