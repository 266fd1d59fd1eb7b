"""Whisper-family speech-to-text behind the same step() interface as LLMEngine, batching requests.

Every Whisper request starts with the same number of decoder tokens (``<|startoftranscript|>``,
language, task, ``<|notimestamps|>``), so requests admitted together form a *cohort* that decodes
as one unpadded batch with one transformers cache: each ``step()`` admits the waiting requests as a
new cohort (one encoder pass for all of them) and advances every cohort by one token. Finished rows
leave their cohort's cache at once. Each step reproduces what ``WhisperForConditionalGeneration
.generate()`` does for short-form audio: language detection over the language tokens when none is
given, ``suppress_tokens`` always, ``begin_suppress_tokens`` on the first token, and
``max_length`` new tokens (capped by the decoder's positions). The generation config is the authority.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from keepwarm_api.values import CacheMode
from keepwarm_runtime.engine.capabilities import EngineCapabilities
from keepwarm_runtime.engine.outputs import CompletionOutput, EngineStats, RequestOutput

if TYPE_CHECKING:
    from keepwarm_runtime.engine.loader import LoadInfo

TASKS = ("transcribe", "translate")


def _load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    socket_dir: str | None,
    mode: str,
    fallback: bool,
    trusted_uids: frozenset[int],
) -> tuple[Any, LoadInfo]:
    """The model built on the meta device and filled from the node weight cache or disk, as LLMEngine's
    loader does; returns it with the engine's one LoadInfo type."""
    from transformers import AutoConfig, GenerationConfig, WhisperForConditionalGeneration

    from keepwarm_runtime.cache.client import attach
    from keepwarm_runtime.engine.loader import LoadInfo, fill_parameters, materialize_buffers
    from keepwarm_runtime.weights import serving_layout

    config = AutoConfig.from_pretrained(model_dir)
    with serving_layout.BUILD_LOCK, torch.device("meta"):  # the default dtype is per process
        model = WhisperForConditionalGeneration._from_config(config, dtype=dtype)
    model.eval()
    res = attach(
        model_dir,
        socket_dir,
        dtype=dtype,
        device=device,
        mode=mode,
        fallback=fallback,
        trusted_uids=trusted_uids,
    )
    fill_parameters(model, res.tensors, res.aliases)
    materialize_buffers(model, device)
    with contextlib.suppress(OSError):  # no generation_config.json: the config's defaults
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model, LoadInfo(res.source, res.seconds, res.reason)


@dataclass(frozen=True)
class TranscriptionParams:
    task: str = "transcribe"  # "transcribe" | "translate"
    language: str | None = None  # ISO code ("en"); None: detect from the audio
    temperature: float = 0.0  # 0: greedy, like generate()'s default
    seed: int | None = None  # for temperature > 0


@dataclass
class TranscriptionOutput(RequestOutput):
    language: str = ""  # the language code given or detected


@dataclass
class _Row:
    request_id: str
    params: TranscriptionParams
    language: str  # the code given or detected
    token_ids: list[int] = field(default_factory=list)  # generated so far (no prompt, no EOS)
    sum_logprob: float = 0.0  # of the chosen tokens under the processed distribution
    generator: torch.Generator | None = None  # for sampling
    finish_reason: str | None = None


@dataclass
class _Cohort:
    rows: list[_Row]  # one per batch row of ``cache`` and ``encoder_out``
    cache: Any  # transformers EncoderDecoderCache
    encoder_out: torch.Tensor  # [rows, frames, d_model]
    last: torch.Tensor  # [rows, 1] the token each row feeds next
    prompt_len: int


class WhisperEngine:
    """Loads a Whisper checkpoint; ``add_request``/``step``/``abort_request`` like LLMEngine.

    Its keyword arguments are named as EngineConfig's fields: `keepwarm serve` passes the engine
    settings its user gave by those names, and refuses the others (server/openai/audio/serving.py)."""

    capabilities = EngineCapabilities(transcription=True)
    max_prompt_logprobs_len = 0  # it scores no prompts

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_num_seqs: int = 32,
        cache_socket_dir: str | None = None,
        cache_mode: str = CacheMode.ZERO_COPY.value,
        cache_fallback: bool = True,
        cache_trusted_uids: frozenset[int] = frozenset(),
    ):
        from transformers import AutoFeatureExtractor, AutoTokenizer, WhisperForConditionalGeneration

        self.device = torch.device(device)
        self.model, self.load_info = _load_model(
            model_dir,
            getattr(torch, dtype),
            self.device,
            cache_socket_dir,
            cache_mode,
            cache_fallback,
            cache_trusted_uids,
        )
        self.feature_extractor = AutoFeatureExtractor.from_pretrained(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.generation_config = gc = self.model.generation_config
        self.max_num_seqs = max_num_seqs
        self.max_model_len = self.model.config.max_target_positions
        self.sample_rate: int = self.feature_extractor.sampling_rate
        self.max_audio_seconds: float = float(self.feature_extractor.chunk_length)  # one window: short-form
        self.eos_token_id: int = gc.eos_token_id if isinstance(gc.eos_token_id, int) else gc.eos_token_id[0]
        self.languages = {
            token.strip("<|>"): i for token, i in (getattr(gc, "lang_to_id", None) or {}).items()
        }
        self._suppress = torch.tensor(gc.suppress_tokens or [], dtype=torch.long)
        self._begin_suppress = torch.tensor(gc.begin_suppress_tokens or [], dtype=torch.long)
        self._waiting: deque[tuple[str, torch.Tensor, TranscriptionParams]] = deque()
        self._cohorts: list[_Cohort] = []
        forward_args = inspect.signature(WhisperForConditionalGeneration.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"  # renamed in 5.x

    # --- requests ---------------------------------------------------------------------------------

    def features(self, samples: torch.Tensor) -> torch.Tensor:
        """Log-mel features [mels, frames] of mono samples at ``sample_rate`` (call off the engine thread)."""
        out = self.feature_extractor(samples.numpy(), sampling_rate=self.sample_rate, return_tensors="pt")
        return out.input_features[0]

    def check_params(self, params: TranscriptionParams) -> None:
        """ValueError for a task or language this checkpoint cannot do."""
        if params.task not in TASKS:
            raise ValueError(f"unknown task {params.task!r}; valid: {', '.join(TASKS)}")
        task_ids = getattr(self.generation_config, "task_to_id", None) or {}
        if params.task not in task_ids:
            raise ValueError(f"this model cannot {params.task} (its generation config names no such task)")
        if params.language is not None and params.language not in self.languages:
            valid = ", ".join(sorted(self.languages)) or "none (English-only model)"
            raise ValueError(f"unsupported language {params.language!r}; this model knows: {valid}")
        if not 0.0 <= params.temperature <= 1.0:
            raise ValueError(f"temperature must be between 0 and 1 (got {params.temperature})")

    def add_request(self, request_id: str, features: torch.Tensor, params: TranscriptionParams) -> None:
        self.check_params(params)
        self._waiting.append((request_id, features, params))

    def abort_request(self, request_id: str) -> None:
        self._waiting = deque(w for w in self._waiting if w[0] != request_id)
        for cohort in self._cohorts:
            for row in cohort.rows:
                if row.request_id == request_id and row.finish_reason is None:
                    row.finish_reason = "abort"
        self._drop_finished()

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._cohorts)

    def work_while_idle(self) -> bool:
        """Nothing to prepare between requests (no decode graphs)."""
        return False

    def stats(self) -> EngineStats:
        running = sum(len(c.rows) for c in self._cohorts)
        return EngineStats(
            num_running=running, num_waiting=len(self._waiting), kv_cache_usage=0.0, num_preemptions=0
        )

    # --- stepping ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Advance every cohort one token; admit waiting requests as a new cohort first."""
        advanced = list(self._cohorts)
        free = self.max_num_seqs - sum(len(c.rows) for c in self._cohorts)
        if self._waiting and free > 0:
            admitted = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            new = self._start_cohort(admitted)
            self._cohorts.append(new)
            outputs = self._emit(new)
        else:
            outputs = []
        for cohort in advanced:
            self._advance(cohort)
            outputs += self._emit(cohort)
        self._drop_finished()
        return outputs

    def _start_cohort(self, admitted: list[tuple[str, torch.Tensor, TranscriptionParams]]) -> _Cohort:
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        features = torch.stack([f for _, f, _ in admitted]).to(self.device, self.model.dtype)
        encoder_out = self.model.model.encoder(features).last_hidden_state
        gc = self.generation_config
        detected = self._detect_languages(encoder_out, [p.language for _, _, p in admitted])
        rows, prompts = [], []
        for (request_id, _, params), language in zip(admitted, detected, strict=True):
            generator = None
            if params.temperature > 0:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed if params.seed is not None else torch.seed())
            rows.append(_Row(request_id, params, language, generator=generator))
            prompt = [gc.decoder_start_token_id]
            if self.languages:
                prompt.append(self.languages[language])
            prompt.append(gc.task_to_id[params.task])
            if getattr(gc, "no_timestamps_token_id", None) is not None:
                prompt.append(gc.no_timestamps_token_id)
            prompts.append(prompt)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        decoder_ids = torch.tensor(prompts, device=self.device)
        cohort = _Cohort(rows, cache, encoder_out, decoder_ids, prompt_len=decoder_ids.shape[1])
        logits = self._decode(cohort, decoder_ids)
        self._choose(cohort, logits, first=True)
        return cohort

    def _detect_languages(self, encoder_out: torch.Tensor, given: list[str | None]) -> list[str]:
        """Each row's language: the one given, else generate()'s detection (argmax over language tokens)."""
        missing = [i for i, lang in enumerate(given) if lang is None]
        if not missing or not self.languages:
            return [lang or "en" for lang in given]
        start = torch.full(
            (len(missing), 1), self.generation_config.decoder_start_token_id, device=self.device
        )
        logits = self.model(
            encoder_outputs=(encoder_out[missing],), decoder_input_ids=start, use_cache=False
        ).logits[:, -1]
        ids = torch.tensor(list(self.languages.values()))
        best = ids[logits[:, ids].argmax(-1).cpu()]
        by_id = {i: code for code, i in self.languages.items()}
        found = dict(zip(missing, (by_id[int(i)] for i in best), strict=True))
        return [lang if lang is not None else found[i] for i, lang in enumerate(given)]

    def _decode(self, cohort: _Cohort, decoder_ids: torch.Tensor) -> torch.Tensor:
        cache_kw = {self._cache_arg: cohort.cache}
        out = self.model(
            encoder_outputs=(cohort.encoder_out,), decoder_input_ids=decoder_ids, use_cache=True, **cache_kw
        )
        return out.logits[:, -1].float()

    def _advance(self, cohort: _Cohort) -> None:
        self._choose(cohort, self._decode(cohort, cohort.last), first=False)

    def _choose(self, cohort: _Cohort, logits: torch.Tensor, *, first: bool) -> None:
        """Pick each row's next token with generate()'s logits processors; mark finished rows."""
        if self._suppress.numel():
            logits[:, self._suppress] = -float("inf")
        if first and self._begin_suppress.numel():
            logits[:, self._begin_suppress] = -float("inf")
        greedy = logits.argmax(-1).tolist()
        logprobs = torch.log_softmax(logits, dim=-1)
        limit = self._max_new_tokens(cohort.prompt_len)
        next_ids = []
        for i, row in enumerate(cohort.rows):
            token = greedy[i]
            if row.generator is not None:
                probs = torch.softmax(logits[i] / row.params.temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=row.generator))
            next_ids.append(token)
            if row.finish_reason is not None:
                continue
            if token == self.eos_token_id:
                row.finish_reason = "stop"
                continue
            row.token_ids.append(token)
            row.sum_logprob += float(logprobs[i, token])
            if len(row.token_ids) >= limit:
                row.finish_reason = "length"
        cohort.last = torch.tensor(next_ids, device=self.device)[:, None]

    def _max_new_tokens(self, prompt_len: int) -> int:
        """generate()'s budget: max_length new tokens, within the decoder's positions."""
        total = min(
            (self.generation_config.max_length or self.max_model_len) + prompt_len, self.max_model_len
        )
        return max(1, total - prompt_len)

    def _emit(self, cohort: _Cohort) -> list[RequestOutput]:
        outputs = []
        for row in cohort.rows:
            if row.finish_reason == "abort":
                continue
            text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
            completion = CompletionOutput(
                0, text, list(row.token_ids), row.sum_logprob, None, row.finish_reason
            )
            finished = row.finish_reason is not None
            outputs.append(
                TranscriptionOutput(row.request_id, None, [], [completion], finished, language=row.language)
            )
        return outputs

    def _drop_finished(self) -> None:
        """Remove finished rows from their cohort's batch; drop empty cohorts."""
        kept = []
        for cohort in self._cohorts:
            alive = [i for i, row in enumerate(cohort.rows) if row.finish_reason is None]
            if not alive:
                continue
            if len(alive) < len(cohort.rows):
                index = torch.tensor(alive, device=self.device)
                cohort.cache.batch_select_indices(index)
                cohort.encoder_out = cohort.encoder_out[index]
                cohort.last = cohort.last[index]
                cohort.rows = [cohort.rows[i] for i in alive]
            kept.append(cohort)
        self._cohorts = kept
