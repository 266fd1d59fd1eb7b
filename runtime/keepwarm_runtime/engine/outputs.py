"""What the engine hands back: vLLM-shaped RequestOutput / CompletionOutput / Logprob, and EngineStats."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float  # natural-log probability under the model's raw distribution
    rank: int  # 1 = most likely token
    decoded_token: str | None = None  # the token's text


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str  # generated text so far (stop string removed unless include_stop_str_in_output)
    token_ids: list[int]  # generated token ids so far
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs (None unless logprobs requested)
    logprobs: list[dict[int, Logprob]] | None  # one dict per generated token: sampled + top alternatives
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # the prompt text, when the request came in as text
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # n completions, in index order
    finished: bool  # all completions finished
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # When asked: one entry per prompt token (the first None), each the token + top alternatives.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # set when this request alone failed (its sequences were aborted)
    # time.perf_counter() when the request's first token was sampled (None before): a FINAL_ONLY
    # request's one output still tells the server its time to first token
    first_token_time: float | None = None


def internal_error(exc: BaseException) -> str:
    """A fault the client did not cause, as it reads it: the server's crash handler and a request's
    failed audio encoding (engine/multimodal.py) say it in the same words."""
    return f"internal error: {type(exc).__name__}: {exc}"


@dataclass
class EngineStats:
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences queued (new or preempted)
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    num_preemptions: int  # total since start
    running_loras: tuple[str, ...] = ()  # LoRA adapters of running sequences (engine/lora), sorted
    waiting_loras: tuple[str, ...] = ()  # LoRA adapters of waiting sequences, sorted
    max_loras: int = 0  # adapter slots; 0: LoRA is off
