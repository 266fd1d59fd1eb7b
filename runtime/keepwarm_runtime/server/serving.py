"""What chat and completions share: model check, request -> SamplingParams, running a request.

``ServingContext`` is the one object the route handlers get; it never reaches into the scheduler,
only into the public engine attributes (tokenizer, max_model_len) and the AsyncEngine queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request

from keepwarm_runtime.server.async_engine import AsyncEngine, EngineRequestError
from keepwarm_runtime.server.errors import APIError, BadRequest, ClientClosedRequest, ModelNotFound, NotReady
from keepwarm_runtime.server.metrics import RequestTimer, ServerMetrics
from keepwarm_runtime.server.protocol import SamplingRequest

logger = logging.getLogger(__name__)

# Request fields copied to SamplingParams under the same name when set.
_PASSTHROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
)


@dataclass
class ServingContext:
    async_engine: AsyncEngine
    metrics: ServerMetrics
    served_model_name: str  # the name clients put in `model`
    model_dir: Path
    _compiler: Any = None  # StructuredOutputCompiler, built on first use
    _token_text: dict[int, str] | None = None  # decoded single tokens, for logprobs

    @property
    def engine(self) -> Any:
        """The loaded LLMEngine, or a 503 while weights are loading."""
        state = self.async_engine.state
        if state != "ready":
            detail = f": {self.async_engine.error}" if self.async_engine.error else ""
            raise NotReady(
                f"the model is not ready yet (engine {state}{detail}); retry shortly", code="model_not_ready"
            )
        return self.async_engine.engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.served_model_name, str(self.model_dir)):
            raise ModelNotFound(model, self.served_model_name)

    # --- prompt and parameters -------------------------------------------------------------------

    def check_length(self, prompt_len: int, max_tokens: int | None) -> int:
        """The generation budget; 400 when the prompt (plus max_tokens) exceeds the context."""
        limit = self.engine.max_model_len
        wanted = prompt_len + (max_tokens or 1)
        if prompt_len >= limit or wanted > limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested {wanted} "
                f"tokens ({prompt_len} in the prompt, {max_tokens or 1} in the completion). Please reduce "
                "the length of the prompt or of max_tokens.",
                param="messages" if max_tokens is None else "max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens if max_tokens is not None else limit - prompt_len

    async def sampling_params(self, request: SamplingRequest, max_tokens: int, logprobs: int | None) -> Any:
        from keepwarm_runtime import SamplingParams

        kwargs: dict[str, Any] = {
            name: getattr(request, name) for name in _PASSTHROUGH if getattr(request, name) is not None
        }
        kwargs.update(n=request.n, stop=request.stop_list(), max_tokens=max_tokens, logprobs=logprobs)
        structured = structured_params(request)
        if structured is not None:
            compiler = self.structured_compiler()
            try:
                kwargs["constraint_factory"] = await asyncio.to_thread(compiler.factory, structured)
            except ValueError as exc:
                param = "response_format" if request.response_format is not None else "structured_outputs"
                raise BadRequest(str(exc), param=param, code="invalid_schema") from exc
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            raise BadRequest(f"invalid sampling parameters: {exc}", code="invalid_value") from exc

    def structured_compiler(self) -> Any:
        if self._compiler is None:
            from keepwarm_runtime.engine.structured import StructuredOutputCompiler

            vocab_size, stop_ids = _model_vocab(self.model_dir, self.engine.tokenizer)
            vocab_size = getattr(self.engine, "vocab_size", None) or vocab_size
            stop_ids = sorted(getattr(self.engine, "eos_token_ids", None) or stop_ids)
            self._compiler = StructuredOutputCompiler(self.engine.tokenizer, vocab_size, stop_ids)
        return self._compiler

    def token_text(self, token_id: int) -> str:
        """The text of one token (engines may report byte-level symbols like 'Ġthe'; clients want text)."""
        cache = self._token_text = self._token_text if self._token_text is not None else {}
        if token_id not in cache:
            cache[token_id] = self.engine.tokenizer.decode([token_id])
        return cache[token_id]

    # --- running ---------------------------------------------------------------------------------

    async def stream(
        self, request_id: str, prompt_ids: Any, params: Any, timer: RequestTimer, multimodal: Any = None
    ) -> AsyncIterator[Any]:
        """The engine's cumulative outputs, with metrics; engine rejections become 400/500 errors."""
        try:
            async for output in self.async_engine.generate(request_id, prompt_ids, params, multimodal):
                timer.tokens(sum(len(o.token_ids) for o in output.outputs))
                yield output
        except EngineRequestError as exc:
            raise (
                BadRequest(str(exc), code="invalid_value") if exc.bad_request else APIError(str(exc))
            ) from exc
        finally:
            timer.done()


def structured_params(request: SamplingRequest) -> Any:
    """The request's constraint as StructuredOutputsParams, or None; ``structured_outputs`` wins."""
    from keepwarm_runtime.engine.structured import StructuredOutputsParams

    so = request.structured_outputs
    if so is not None:
        return StructuredOutputsParams(
            json=so.json_,
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
            json_object=bool(so.json_object),
            any_whitespace=so.any_whitespace,
        )
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise BadRequest("response_format json_schema needs json_schema.schema", param="response_format")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


def _model_vocab(model_dir: Path, tokenizer: Any) -> tuple[int, list[int]]:
    """(logits width, stop token ids) from config.json / generation_config.json, else the tokenizer."""

    def read(name: str) -> dict:
        try:
            return json.loads((model_dir / name).read_text())
        except (OSError, ValueError):
            return {}

    config = read("config.json")
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or len(tokenizer)
    eos = read("generation_config.json").get("eos_token_id", config.get("eos_token_id"))
    stop = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stop:
        stop.append(tokenizer.eos_token_id)
    return int(vocab), stop


async def race_disconnect(awaitable: Any, request: Request) -> Any:
    """Await ``awaitable``; if the client disconnects first, cancel it (which aborts its sequence)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientClosedRequest("client disconnected", code="client_disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
