"""The serving base every OpenAI route shares: model check, prompt work off the event loop,
request -> SamplingParams with every field honoured or refused by name, running a request.

``ServingContext`` is the one object the route handlers get; it talks to the engine only through the
``EngineClient`` protocol and the AsyncEngine queues, never the scheduler. Tokenizing and template
rendering run in a small worker pool with a time bound, so a huge prompt never stalls /health.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from keepwarm_runtime.server.async_engine import AsyncEngine, EngineRequestError
from keepwarm_runtime.server.base.deltas import Accumulated
from keepwarm_runtime.server.base.errors import (
    APIError,
    BadRequest,
    ClientClosedRequest,
    ModelNotFound,
    NotReady,
)
from keepwarm_runtime.server.base.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_PREPROCESS_TIMEOUT_S
from keepwarm_runtime.server.base.lora_modules import LoraModule
from keepwarm_runtime.server.base.metrics import RequestTimer, ServerMetrics
from keepwarm_runtime.server.base.protocol import SamplingRequest
from keepwarm_runtime.server.engine_client import EngineClient

if TYPE_CHECKING:
    from keepwarm_runtime.engine.multimodal import AudioFeatures
    from keepwarm_runtime.engine.outputs import RequestOutput
    from keepwarm_runtime.engine.sampling_params import SamplingParams
    from keepwarm_runtime.engine.structured import StructuredOutputCompiler, StructuredOutputsParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

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
    "allowed_token_ids",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
)
# SamplingParams field -> the request field a client would recognise in an error.
_PARAM_NAMES = {"bad_words_token_ids": "bad_words"}


@dataclass(frozen=True)
class ServingOptions:
    """Server-wide settings the routes honour (flags of `keepwarm serve`)."""

    trust_request_chat_template: bool = False  # let requests send their own Jinja chat template
    tool_call_parser: str | None = None  # parses tool calls for tool_choice "auto"
    preprocess_timeout_s: float = DEFAULT_PREPROCESS_TIMEOUT_S  # bound on tokenizing/rendering one request
    preprocess_workers: int = 2  # threads for tokenizing/rendering
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None  # Bearer key every route but probes and metrics needs
    lora_modules: tuple[LoraModule, ...] = ()  # adapters loaded at start (openai/lora/serving.py)
    lora_modules_file: str | None = None  # adapters kept in step with this file (openai/lora/file_sync.py)
    allow_runtime_lora_updating: bool = False  # the load/unload adapter routes exist


@dataclass
class ServingContext:
    async_engine: AsyncEngine
    metrics: ServerMetrics
    served_model_name: str  # the name clients put in `model`
    model_dir: Path
    options: ServingOptions = field(default_factory=ServingOptions)
    loras: dict[str, LoraModule] = field(default_factory=dict)  # adapters clients may name in `model`
    lora_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # held while adapters come or go
    lora_synced: asyncio.Event | None = None  # set once --lora-modules-file's first pass is done, when given
    _compiler: StructuredOutputCompiler | None = None  # built on first use
    _pool: ThreadPoolExecutor | None = None

    @property
    def engine(self) -> EngineClient:
        """The loaded engine, or a 503 while weights are loading (or after the engine failed)."""
        state, engine = self.async_engine.state, self.async_engine.engine
        if state == "sleeping":
            raise NotReady("the model is asleep (POST /sleep): POST /wake_up wakes it", code="model_sleeping")
        if state != "ready" or engine is None:
            detail = f": {self.async_engine.error}" if self.async_engine.error else ""
            raise NotReady(
                f"the model is not ready (engine {state}{detail}); retry shortly", code="model_not_ready"
            )
        return engine

    def check_model(self, model: str | None) -> None:
        served = (self.served_model_name, str(self.model_dir), *self.loras)
        if model is not None and model not in served:
            raise ModelNotFound(model, self.served_model_name)

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response names: the adapter the request selected, else the served name."""
        return self.lora_name(model) or self.served_model_name

    def lora_name(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` selects, None for the base model."""
        return model if model in self.loras else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # --- prompt work, off the event loop -----------------------------------------------------------

    async def preprocess(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in the worker pool; 400 if it takes longer than the preprocess bound."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self.options.preprocess_workers, thread_name_prefix="keepwarm-prep"
            )
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.wait_for(future, self.options.preprocess_timeout_s)
        except TimeoutError as exc:
            raise BadRequest(
                f"preparing the prompt took longer than {self.options.preprocess_timeout_s:g}s; send less",
                code="preprocess_timeout",
            ) from exc

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self.engine.tokenizer
        return await self.preprocess(
            lambda: list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        )

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

    def check_prompt_logprobs(self, prompt_len: int, param: str) -> None:
        """400 naming ``param`` when the engine scores no prompts (a speech engine's limit is 0), or a
        prompt longer than it scores (--max-prompt-logprobs-len)."""
        limit = self.engine.max_prompt_logprobs_len
        if not limit:
            raise BadRequest(f"{param}: this model's engine does not compute prompt logprobs", param=param)
        if prompt_len > limit:
            raise BadRequest(
                f"{param}: the prompt has {prompt_len} tokens; this server returns prompt logprobs for "
                f"prompts of at most {limit} tokens (--max-prompt-logprobs-len)",
                param=param,
            )

    # --- parameters --------------------------------------------------------------------------------

    async def sampling_params(
        self,
        request: SamplingRequest,
        max_tokens: int,
        logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
        structured_param: str = "structured_outputs",
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Every sampling field of ``request`` honoured, or a 400 naming the one that cannot be.
        ``prompt_logprobs``: asked by another field (completions' echo with logprobs)."""
        from keepwarm_runtime.engine.sampling_params import SamplingParams

        refuse_unsupported(request)
        kwargs: dict[str, Any] = {
            name: getattr(request, name) for name in _PASSTHROUGH if getattr(request, name) is not None
        }
        kwargs.update(n=request.n, stop=request.stop_list(), max_tokens=max_tokens, logprobs=logprobs)
        if request.prompt_logprobs is not None or prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = max(request.prompt_logprobs or 0, prompt_logprobs or 0)
        kwargs["logit_bias"] = request.token_bias()
        if request.bad_words:
            kwargs["bad_words_token_ids"] = await self.preprocess(self._bad_words_ids, request.bad_words)
        if structured is None:
            structured = structured_params(request)
            structured_param = (
                "response_format" if request.response_format is not None else "structured_outputs"
            )
        if structured is not None:
            compiler = await self.preprocess(self.structured_compiler)
            try:
                kwargs["constraint_factory"] = await self.preprocess(compiler.factory, structured)
            except ValueError as exc:
                raise BadRequest(str(exc), param=structured_param, code="invalid_schema") from exc
        try:
            params = SamplingParams(**kwargs)
            params.validate(self.engine.vocab_size)
        except (ValueError, TypeError) as exc:
            field_name = str(exc).split(" ", 1)[0]
            raise BadRequest(
                f"invalid sampling parameters: {exc}",
                param=_PARAM_NAMES.get(field_name, field_name if field_name.isidentifier() else None),
                code="invalid_value",
            ) from exc
        return params

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, with and without a leading space (how it appears mid-text)."""
        tokenizer, sequences = self.engine.tokenizer, []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def structured_compiler(self) -> StructuredOutputCompiler:
        """The grammar compiler for this engine's tokenizer, built once (vocab and EOS from the engine)."""
        if self._compiler is None:
            from keepwarm_runtime.engine.structured import StructuredOutputCompiler

            engine = self.engine
            self._compiler = StructuredOutputCompiler(
                engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids)
            )
        return self._compiler

    # --- running -----------------------------------------------------------------------------------

    async def stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        timer: RequestTimer,
        priority: int = 0,
        audio: AudioFeatures | None = None,
        lora_name: str | None = None,
        streaming: bool | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs, with metrics (per adapter too); engine rejections become
        400/500 errors. ``streaming`` False: the caller reads only the last output (a response that
        does not stream), so the engine builds no other (RequestOutputKind.FINAL_ONLY) and the metrics
        take the first token's time from it. True: the engine hands back deltas (DELTA), put together
        here (deltas.Accumulated: one output object, updated in place before each yield), all that
        is queued at once: a stream that fell behind the engine catches up in one chunk, not one a
        token. None: the params' own kind (a transcription's)."""
        timer.adapter = lora_name
        together = None
        if streaming is not None:
            from keepwarm_runtime.engine.sampling_params import RequestOutputKind

            kind = RequestOutputKind.DELTA if streaming else RequestOutputKind.FINAL_ONLY
            params = replace(params, output_kind=kind)
            together = Accumulated() if streaming else None
        try:
            async for batch in self.async_engine.generate(
                request_id, prompt_ids, params, priority, audio, lora_name
            ):
                if together is not None:
                    for delta in batch:
                        output = together.add(delta)
                    batch = [output]
                for output in batch:
                    timer.tokens(sum(len(o.token_ids) for o in output.outputs), output.first_token_time)
                    yield output
        except EngineRequestError as exc:
            raise (
                BadRequest(str(exc), code="invalid_value") if exc.bad_request else APIError(str(exc))
            ) from exc
        finally:
            timer.done()


def refuse_unsupported(request: SamplingRequest) -> None:
    """400s for fields this server accepts in the schema but cannot honour."""
    if request.prompt_logprobs is not None and request.stream:
        raise BadRequest("prompt_logprobs is not available with stream=true", param="prompt_logprobs")
    if request.best_of is not None and request.best_of != request.n:
        raise BadRequest(
            "best_of must equal n (or be left out): candidates are not ranked, all n are returned",
            param="best_of",
        )


def truncate_prompt(ids: list[int], keep: int | None) -> list[int]:
    """``truncate_prompt_tokens``: keep the last ``keep`` tokens (the end of a prompt matters most)."""
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


def structured_params(request: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's constraint as StructuredOutputsParams, or None; ``structured_outputs`` wins.

    A request without one imports nothing: the grammar stacks (xgrammar, llguidance) load on the
    first constrained request, so a server that never sees one never pays for them."""
    so, fmt = request.structured_outputs, request.response_format
    if so is None and (fmt is None or fmt.type == "text"):
        return None
    from keepwarm_runtime.engine.structured import StructuredOutputsParams

    if so is not None:
        return StructuredOutputsParams(
            json=so.json_,
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
            json_object=bool(so.json_object),
            any_whitespace=so.any_whitespace,
        )
    assert fmt is not None  # checked above: no constraint means None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise BadRequest("response_format json_schema needs json_schema.schema", param="response_format")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


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
