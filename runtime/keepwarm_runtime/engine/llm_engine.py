"""LLMEngine: add requests, step, get outputs. One thread drives it (the server's loop or LLM).

A request enters whole or not at all: every sequence, constraint and generator is built before any
reaches the scheduler. A fault while sampling or post-processing one request (a constraint that
raises, a detokenizer error, scoring its prompt) finishes that request alone, with
``RequestOutput.error`` set; the other sequences of the step carry on. Prompt logprobs, when asked,
are stored as each prefill chunk computes them (engine/prompt_logprobs.py); a request with
``max_tokens`` 0 finishes once its prompt is in, sampling nothing. A request with audio
(``AudioFeatures``) has its audio encoded at the start of the next step, before it can be scheduled;
an encoder fault fails that request alone, as ``internal_error`` words it.

A request's ``output_kind`` (RequestOutputKind) says which outputs it gets: one at every step that
samples it, with everything so far (CUMULATIVE) or only what is new (DELTA), or one when it finishes or
fails (FINAL_ONLY: no output is built on the steps before, and its text is detokenised once it finishes
unless stop strings need it as it grows). While a request with stop strings runs, the end of its text
that could be the start of one is held back from its outputs.

With ``enable_lora`` a request may name a registered PEFT adapter (``add_lora``); requests for
different adapters and the base share batches (engine/lora). Adapters come through the node cache
when the engine has a cache socket, as its weights do.

With ``tensor_parallel_size`` > 1 the engine is one rank of a group (engine/parallel): it joins the
group before loading its shard, the ranks agree on one KV-cache size, and rank 0's runner shares
each step with the others, which build the same engine and only follow.

On CUDA, decode steps replay a CUDA graph per batch-size bucket (engine/decode_graphs.py; one KV block
is kept for their padding rows) unless ``enforce_eager``; any step they do not take runs eagerly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from keepwarm_runtime.engine.attention.fuser import fuse_attention
from keepwarm_runtime.engine.attention.select import select_backend
from keepwarm_runtime.engine.block_manager import BlockManager, cdiv
from keepwarm_runtime.engine.capabilities import EngineCapabilities
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.cpu_fused import FusedModules, use_fused_ops
from keepwarm_runtime.engine.cpu_linear import (
    LinearPacker,
    needs_packed_copy,
    packed_weights_supported,
    use_amx_linear,
    use_bf16_linear,
    use_f32_linear,
    use_packed_linear,
    use_weight_major_linear,
)
from keepwarm_runtime.engine.decode_graphs import DecodeGraphs, capture_sizes, graph_bytes
from keepwarm_runtime.engine.detokenizer import IncrementalDetokenizer, StandaloneTexts, find_stop
from keepwarm_runtime.engine.host_memory import keep_freed_memory
from keepwarm_runtime.engine.kv_cache import allocate_kv_cache, num_blocks_for, probe_kv_specs
from keepwarm_runtime.engine.loader import LoadInfo, load_model
from keepwarm_runtime.engine.lora import LoraInUse, LoraSlots
from keepwarm_runtime.engine.lora.adapter import AdapterCache, LoraWeights
from keepwarm_runtime.engine.model_runner import ModelRunner, StepLogits
from keepwarm_runtime.engine.multimodal import AudioFeatures, audio_spec, encode, placeholder_mismatch
from keepwarm_runtime.engine.outputs import CompletionOutput, EngineStats, RequestOutput, internal_error
from keepwarm_runtime.engine.overlap import Launched, greedy_ahead, sampled_ahead, sources_of
from keepwarm_runtime.engine.parallel import group as parallel_group
from keepwarm_runtime.engine.parallel.layers import output_vocab_size
from keepwarm_runtime.engine.parallel.runner import ParallelRunner
from keepwarm_runtime.engine.prefetch import WeightPrefetch
from keepwarm_runtime.engine.prompt_logprobs import PromptChunk, store
from keepwarm_runtime.engine.sampler import SampledToken, Sampler
from keepwarm_runtime.engine.sampling_params import RequestOutputKind, SamplingParams
from keepwarm_runtime.engine.scheduler import Scheduler, SchedulerOutput
from keepwarm_runtime.engine.sequence import Sequence, SequenceStatus
from keepwarm_runtime.engine.startup import StartupProfile
from keepwarm_runtime.engine.step_inputs import StepTables

log = logging.getLogger(__name__)


@dataclass(slots=True)  # read for every sequence of every step
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer] = field(default_factory=list)
    audio: AudioFeatures | None = None  # until the step encodes it (engine/multimodal.py)
    final_only: bool = False  # RequestOutputKind.FINAL_ONLY: an output only once finished or failed
    delta: bool = False  # RequestOutputKind.DELTA: each output only what is new since the last
    hold: int = 0  # characters of a running sequence's text held back (a stop string may start there)
    prompt_logprobs_sent: bool = False  # DELTA: the first output carried them
    text_each_step: bool = True  # detokenise as tokens come (outputs or stop strings read the text)
    first_token_time: float | None = None  # time.perf_counter() when its first token was sampled


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        profile: StartupProfile | None = None,
        prefetch: WeightPrefetch | None = None,
    ):
        """``profile``: where start-up phases are marked (the server passes one that began at process
        start); by default a profile of this constructor alone, kept as ``self.startup``. ``prefetch``:
        the weights' attach, begun in the background by the server (engine/prefetch.py)."""
        from transformers import AutoTokenizer, GenerationConfig

        self.startup = profile = profile or StartupProfile()
        self.config = config
        self.parallel = parallel_group.join(config)  # one rank of a tensor-parallel group (engine/parallel)
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's large temporaries reuse heap memory (engine/host_memory.py)
        self.model, info = load_model(config, profile, prefetch)
        cpu = self.device.type == "cpu"  # engine/cpu_linear.py
        # float32: steps of few tokens on the AVX-512 kernel where the CPU has it, else weight-major
        f32_layers = use_weight_major_linear(self.model) if cpu else []
        self.f32_linear_layers = use_f32_linear(
            f32_layers if config.cpu_f32_linear else [], config.kernel_cache
        )
        # bfloat16 where oneDNN runs it natively: steps of up to 64 tokens on AMX tiles where the CPU
        # has them, else all of them on the AVX-512 BF16 kernel, the others on oneDNN's packed weights, made
        # in the background once the engine is built
        wanted = config.cpu_packed_weights or config.cpu_amx_linear or config.cpu_bf16_linear
        bf16_layers = use_packed_linear(self.model) if cpu and wanted and packed_weights_supported() else []
        amx_layers = bf16_layers if config.cpu_amx_linear else []
        self.amx_linear_layers = use_amx_linear(amx_layers, config.kernel_cache)
        self.bf16_linear_layers = use_bf16_linear(
            bf16_layers if config.cpu_bf16_linear else [], config.kernel_cache
        )
        # layers on the AVX-512 BF16 kernel for every step need no packed copy
        unpacked = [layer for layer in bf16_layers if needs_packed_copy(layer)]
        self.linear_packer = LinearPacker(unpacked if config.cpu_packed_weights else [])
        # bfloat16/float16: fused norm, activation and rotary kernels (engine/cpu_fused.py)
        fuses = cpu and config.cpu_fused_ops
        self.fused_ops = (
            use_fused_ops(self.model, config.torch_dtype, config.kernel_cache) if fuses else FusedModules()
        )
        self.load_info: LoadInfo = info
        self.moe_backends = {c.module: c.backend for c in info.moe}  # experts module -> MoE backend
        self.model_name = config.model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
        self.eos_token_ids = set(_eos_ids(config.model_dir, self.tokenizer, GenerationConfig))
        self._standalone = StandaloneTexts.for_tokenizer(self.tokenizer)  # detokenizing's tables
        profile.mark("tokenizer")
        self.layers = fuse_attention(self.model.get_decoder())
        backend = select_backend(config.attention_backend, self.device, kernel_cache=config.kernel_cache)
        for layer in self.layers:
            layer.backend = backend
        self.attention_backend = backend.name
        profile.mark("attention")

        text_config = self.model.config.get_text_config()
        model_len = getattr(text_config, "max_position_embeddings", None) or 2048
        max_len = min(config.max_model_len or model_len, model_len)
        specs = probe_kv_specs(self.model, self.layers, self.device)
        graphs = self._graphs_wanted(backend)
        pool = self._graph_bytes(text_config, max_len) if graphs else 0
        num_blocks = parallel_group.fewest(num_blocks_for(config, specs, max_len, self.device, pool))
        allocate_kv_cache(self.layers, specs, num_blocks, config.block_size, config.torch_dtype, self.device)
        self.kv_specs, self.num_kv_blocks = (
            specs,
            num_blocks,
        )  # to allocate it again on wake (engine/sleep.py)
        self.max_model_len = min(max_len, num_blocks * config.block_size)
        self.vocab_size = output_vocab_size(self.model)
        self.max_prompt_logprobs_len = config.max_prompt_logprobs_len

        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        cache = AdapterCache(
            config.cache_socket_dir, config.cache_mode, config.cache_fallback, config.cache_trusted_uids
        )
        self.lora = (
            LoraSlots(self.model, config.max_loras, config.max_lora_rank, cache)
            if config.enable_lora
            else None
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.lora
        )
        runner = ParallelRunner if self.parallel else ModelRunner  # rank 0 shares each step
        self.runner = runner(self.model, config.block_size, self.device, self.lora)
        self.capabilities = EngineCapabilities(
            audio=audio_spec(self.model.config),
            lora=self.lora,
            startup=profile,
            moe_backends=self.moe_backends,
        )
        self.sampler = Sampler(self.eos_token_ids, config.seed, self.device)
        self.requests: dict[str, _Request] = {}
        self._unencoded: list[_Request] = []  # arrived with audio; step() encodes it first
        self._token_text: dict[int, str] = {}  # decoded single tokens, for logprob alternatives
        self.graph_capture: bool | None = None  # decode graphs: captured (CUDA), the CPU twin, or none
        self._running: Launched | None = None  # a step that ran ahead, to land (engine/overlap.py)
        self._held: list[RequestOutput] = []  # outputs landed between steps (settle), for the next step
        self.async_scheduling = self._overlap_wanted()  # steps overlapped (engine/overlap.py)
        if graphs:
            self.use_decode_graphs()
        profile.mark("kv_alloc")
        self.linear_packer.start()  # in the background: steps use each layer once it is packed
        log.info(
            "engine ready: %s from %s in %.2fs, %d KV blocks x %d tokens, attention %s",
            config.model_dir,
            info.source,
            info.seconds,
            num_blocks,
            config.block_size,
            backend.name,
        )

    def _graphs_wanted(self, backend) -> bool:
        """Decode steps from CUDA graphs: on CUDA, unless --enforce-eager, with a backend that plans
        them (FlashInfer), one process, no LoRA and no multimodal inputs (engine/decode_graphs.py)."""
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and hasattr(backend, "graph_metadata")
            and not self.parallel
            and not self.config.enable_lora
            and audio_spec(self.model.config) is None
        )

    def _overlap_wanted(self) -> bool:
        """Overlapped steps (engine/overlap.py): on CUDA unless --no-async-scheduling, on CPU only when
        asked (nothing overlaps there); never on a tensor-parallel rank."""
        wanted = self.config.async_scheduling
        return (self.device.type == "cuda" if wanted is None else wanted) and not self.parallel

    def _graph_bytes(self, text_config, max_len: int) -> int:
        hidden = text_config.hidden_size
        intermediate = getattr(text_config, "intermediate_size", None) or 4 * hidden
        sizes = capture_sizes(self.config.max_num_seqs)
        blocks = cdiv(max_len, self.config.block_size)
        itemsize = self.config.torch_dtype.itemsize
        return graph_bytes(hidden, intermediate, text_config.vocab_size, itemsize, sizes, blocks)

    def use_decode_graphs(self, capture: bool = True) -> None:
        """Decode steps replayed from per-bucket graphs over static buffers, their padding rows
        writing to a KV block taken out of circulation here; ``capture=False``: the CPU twin, the same
        padded steps run eagerly (tests). Again after a wake: the graphs read the KV cache's memory."""
        if self.block_manager.num_free_blocks < 2:  # the reserved block would leave no sequence one
            log.info("decode graphs off: %d KV block(s) free", self.block_manager.num_free_blocks)
            return
        self.graph_capture = capture
        self.runner.graphs = DecodeGraphs(
            self.runner.forward,
            self.runner.backend(),
            self.device,
            self.config.max_num_seqs,
            cdiv(self.max_model_len, self.config.block_size) + 1,  # a sequence's longest block table
            self.config.block_size,
            self.block_manager.reserve(),
            capture,
        )

    def warm_up(self) -> None:
        """Pay the first step's one-time costs before the server says ready, not on a client's request.

        On a GPU: one short greedy request (a few tokens and a decode step), forgotten after; its
        prefill and decode kernels load on first use. On CPU the KV probe has already run the whole
        model once in this process (OpenMP's threads, oneDNN's kernel selection), and every further
        pass reads all the weights again: a one-token warm-up step cost 0.20-0.22 s of a 1 GiB
        model's start on 2 cores, while what a first step adds beyond the probe (the attention
        backend's paged path, sampling, detokenizing) cost the first request 0.01-0.08 s, so on CPU
        there is no warm-up step. Greedy, so the sampler's random stream is untouched; the prompt is
        plain text (never a special or multimodal placeholder token, which would need inputs of its
        own) and fills no block unless blocks hold two tokens or fewer, so the prefix cache stays empty."""
        if self.device.type != "cpu":
            self.run_warm_up_request()
        self.startup.mark("warmup")

    def run_warm_up_request(self) -> None:
        """The warm-up's request: a few plain-text tokens and a decode step, greedy, run to its end.
        Its prompt and first token stay short of a block, so no block is filled and cached."""
        request_id = "keepwarm-warm-up"
        text_ids = self.tokenizer.encode("keep the weights warm", add_special_tokens=False) or [0]
        prompt = text_ids[: max(1, min(self.config.block_size - 2, self.max_model_len - 2))]
        self.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        graphs, self.runner.graphs = self.runner.graphs, None  # captured once ready (work_while_idle)
        try:
            while request_id in self.requests:
                self.step()
            self.settle()  # a step that ran ahead of its end
        finally:
            self.runner.graphs = graphs

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        audio: AudioFeatures | None = None,  # for the placeholders; step() encodes it (engine/multimodal.py)
        lora_name: str | None = None,  # a registered adapter (add_lora); None: the base model
    ) -> None:
        """Queue a request (lower ``priority`` first); ValueError, and nothing queued, if it is invalid."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_name is not None and lora_name not in self.lora_names():
            raise ValueError(f"LoRA adapter {lora_name!r} is not loaded")
        params.validate(self.vocab_size)
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this engine's max_model_len is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if params.prompt_logprobs is not None and len(ids) > self.max_prompt_logprobs_len:
            raise ValueError(
                f"prompt_logprobs: the prompt has {len(ids)} tokens; this engine scores prompts of at most "
                f"{self.max_prompt_logprobs_len} (max_prompt_logprobs_len)"
            )
        self._check_audio(ids, audio)
        seqs = [self._new_sequence(request_id, i, ids, params, priority) for i in range(params.n)]
        for seq in seqs:
            seq.lora_name, seq.lora_id = lora_name, self.lora.ids[lora_name] if lora_name is not None else 0
        final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        request = _Request(request_id, prompt, ids, seqs, audio=audio, final_only=final_only)
        request.delta = params.output_kind is RequestOutputKind.DELTA
        request.hold = stop_hold(params)
        request.text_each_step = not final_only or bool(params.stop)
        skip = params.skip_special_tokens
        standalone = self._standalone[skip] if self._standalone is not None else None
        request.detokenizers = [IncrementalDetokenizer(self.tokenizer, skip, standalone) for _ in seqs]
        for seq in seqs:  # nothing below can fail: the request is complete
            self.scheduler.add(seq)
        self.requests[request_id] = request
        if audio is not None:
            self._unencoded.append(request)

    def _new_sequence(
        self,
        request_id: str,
        index: int,
        ids: list[int],
        params: SamplingParams,
        priority: int,
    ) -> Sequence:
        seq = Sequence(request_id, index, ids, params, priority=priority)
        if params.constraint_factory is not None:
            seq.constraint = params.constraint_factory()
        seed = params.sequence_seed(index)
        if seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        return seq

    def _check_audio(self, ids: list[int], audio: AudioFeatures | None) -> None:
        """ValueError unless the prompt's placeholders are as many as the audio's embeddings will be."""
        if audio is None:
            return
        spec = self.capabilities.audio
        if spec is None:
            raise ValueError("this model does not take audio input")
        count = sum(spec.count(clip) for clip in audio.clips)
        if (why := placeholder_mismatch(ids, spec.placeholder_id, count)) is not None:
            raise ValueError(why)

    def _encode_audio(self) -> dict[str, str]:
        """Run the audio encoder for the requests that arrived with audio since the last step, in
        arrival order, before any of their sequences is scheduled; a request whose encoding raises
        fails alone (id -> why). Each clip goes through the encoder alone, in the shapes the model's
        own forward() gives it, so the embeddings are the reference's bit for bit."""
        pending, self._unencoded = self._unencoded, []
        failed: dict[str, str] = {}
        for request in pending:
            audio, request.audio = request.audio, None
            if audio is None or self.requests.get(request.request_id) is not request:
                continue  # aborted meanwhile
            try:
                encoded = encode(self.model, request.prompt_token_ids, audio)
            except Exception as exc:
                log.exception("encoding the audio of request %s failed; failing it alone", request.request_id)
                failed[request.request_id] = internal_error(exc)
                continue
            for seq in request.seqs:
                seq.multimodal = encoded
        return failed

    def add_lora(self, name: str, path: str) -> LoraWeights:
        """Register a PEFT adapter; LoraLoadError names what is wrong and changes nothing."""
        return self.register_lora(self.read_lora(name, path))

    def read_lora(self, name: str, path: str) -> LoraWeights:
        """Read and check an adapter without touching the engine's state: callable from any thread
        while steps run (the server reads there, so a load never pauses the batch)."""
        return self._lora_slots().read(name, path)

    def register_lora(self, weights: LoraWeights) -> LoraWeights:
        """Make an adapter read by ``read_lora`` selectable; in the engine's thread, between steps."""
        return self._lora_slots().register(weights)

    def _lora_slots(self) -> LoraSlots:
        if self.lora is None:
            raise ValueError("this engine was started without enable_lora")
        return self.lora

    def remove_lora(self, name: str) -> None:
        """Forget an adapter: KeyError if unknown, LoraInUse while unfinished requests (queued or
        running) name it, so weights in use are never freed."""
        if self.lora is None or name not in self.lora.adapters:
            raise KeyError(name)
        users = [r for r in self.requests.values() if any(s.lora_name == name for s in r.seqs)]
        if users:
            raise LoraInUse(f"LoRA adapter {name!r} is in use by {len(users)} unfinished requests")
        self.lora.remove(name)

    def lora_names(self) -> list[str]:
        return list(self.lora.adapters) if self.lora is not None else []

    def token_text(self, token_id: int) -> str:
        """One token's text as a client reads it (not its byte-level symbol such as 'Ġthe')."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        for seq in request.seqs if request else []:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def work_while_idle(self) -> bool:
        """One piece of what an idle engine does ahead of its requests: the next decode graph's capture
        (engine/decode_graphs.py), so no request waits for one. False when nothing is left to do, or
        while there are requests."""
        graphs = self.runner.graphs
        if graphs is None or self.has_unfinished_requests():
            return False
        self.settle()  # a step left running for sequences since finished
        return graphs.capture_next() is not None

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or outputs landed but not yet handed out. A step still running for
        sequences that have all finished or been aborted since it was launched is not work: its
        outputs would be dropped, and the next step (or ``settle``) lands it."""
        return self.scheduler.has_unfinished() or bool(self._held)

    def stats(self) -> EngineStats:
        s = self.scheduler
        stats = EngineStats(len(s.running), len(s.waiting), self.block_manager.usage(), s.num_preemptions)
        if self.lora is not None:
            stats.running_loras = tuple(sorted({q.lora_name for q in s.running if q.lora_name is not None}))
            stats.waiting_loras = tuple(sorted({q.lora_name for q in s.waiting if q.lora_name is not None}))
            stats.max_loras = self.lora.max_loras
        return stats

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, then land the step before it if that one ran ahead, and this
        one unless it runs ahead (engine/overlap.py)."""
        outputs, self._held = self._held, []
        outputs += [self._report(rid, why) for rid, why in self._encode_audio().items()]
        batch = self.scheduler.schedule()
        launched = None if batch.is_empty() else self._launch(batch)
        running, self._running = self._running, None
        if running is not None:
            outputs += self._land(running)
        if launched is not None and launched.tokens is not None:
            self._running = launched
        elif launched is not None:
            outputs += self._land(launched)
        return outputs

    def settle(self) -> None:
        """Land the step still running, if any; its outputs come with the next ``step()`` (sleep)."""
        running, self._running = self._running, None
        if running is not None:
            self._held += self._land(running)

    def _launch(self, batch: SchedulerOutput) -> Launched:
        """Run (CPU) or launch (CUDA) the batch's pass; sample it now if it may run ahead."""
        tables = self.runner.prepare(batch)
        pending = None
        if len(tables.pending_seqs):  # their tokens: from the step not yet landed, on the device
            running = self._running
            sources = sources_of(tables.pending_seqs, batch.seqs, running.step.sample_seqs)
            pending = running.tokens.device
            if sources is not None:
                pending = pending[torch.from_numpy(sources).to(pending.device)]
        step = self.runner.execute(batch, tables, pending)
        self.scheduler.update_after_step(batch)
        if not (self.async_scheduling and self._runs_ahead(tables)):
            return Launched(step)
        seqs = step.sample_seqs
        for seq in seqs:
            seq.num_pending += 1
        if self.sampler.all_plain_greedy(seqs):
            tokens = greedy_ahead(step.logits)
        else:
            tokens = sampled_ahead(self.sampler(seqs, step.logits), self.device)
        return Launched(StepLogits(sample_seqs=seqs), tokens)  # its logits freed: only tokens land

    @staticmethod
    def _runs_ahead(tables: StepTables) -> bool:
        """Whether the next step may be launched before this one lands (engine/overlap.py)."""
        rows = tables.rows
        return (
            bool(rows.sample_seqs)
            and not rows.prompt_index
            and all(s.samples_ahead for s in rows.sample_seqs)
        )

    def _land(self, launched: Launched) -> list[RequestOutput]:
        """A launched step's outputs: its tokens appended (sampled now unless it ran ahead), stops
        checked, prompt logprobs stored."""
        step, ahead = launched.step, launched.tokens
        if ahead is not None:
            for seq in step.sample_seqs:
                seq.num_pending -= 1
            outputs = self._postprocess(step.sample_seqs, ahead.tolist(), ahead.sampled)
            self.scheduler.cache_landed(step.sample_seqs)
            return outputs
        failed = self._score_prompts(step.prompt_chunks, step.prompt_logits)
        seqs, logits, scored_only = self._to_sample(step, failed)
        outputs = self._sample_and_append(seqs, logits) if seqs else []
        unsampled = (scored_only | set(failed)) - {o.request_id for o in outputs}
        reported = [self._report(rid, failed.get(rid)) for rid in unsampled if rid in self.requests]
        return outputs + reported

    def _to_sample(
        self, step: StepLogits, failed: dict[str, str]
    ) -> tuple[list[Sequence], torch.Tensor | None, set[str]]:
        """The sequences to sample and their logits rows; a scoring-only sequence (max_tokens 0) has
        its prompt in and finishes here instead (its request id is returned), a failed one is skipped."""
        rows: list[int] = []
        scored_only: set[str] = set()
        for row, seq in enumerate(step.sample_seqs):
            if seq.request_id in failed:
                continue
            if seq.params.max_tokens == 0:
                self._finish(seq, "length", None)
                scored_only.add(seq.request_id)
            else:
                rows.append(row)
        seqs = [step.sample_seqs[row] for row in rows]
        if len(rows) == len(step.sample_seqs) or step.logits is None:
            return seqs, step.logits, scored_only
        return seqs, step.logits[rows] if rows else None, scored_only

    def _score_prompts(self, chunks: list[PromptChunk], logits: torch.Tensor | None) -> dict[str, str]:
        """Store this step's prompt logprobs; a request whose scoring raises fails alone (id -> why)."""
        failed: dict[str, str] = {}
        row = 0
        for chunk in chunks:
            seq = chunk.seq
            try:
                for entry in store(chunk, logits[row : row + chunk.count]):
                    for tid, lp in entry.items():
                        lp.decoded_token = self.token_text(tid)
            except Exception as exc:
                log.exception("scoring the prompt of request %s failed; failing it alone", seq.request_id)
                failed[seq.request_id] = f"prompt logprobs failed: {type(exc).__name__}: {exc}"
            row += chunk.count
        return failed

    def _report(self, request_id: str, error: str | None) -> RequestOutput:
        """The output of a request this step touched without sampling (scoring only, or failed)."""
        request = self.requests[request_id]
        if error is not None:
            self.abort_request(request_id)
        output = self._output(request, error)
        if output.finished:
            self.requests.pop(request_id, None)
        return output

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> list[RequestOutput]:
        """Sample the step's tokens and post-process them: a batch of plain greedy rows takes the
        sampler's argmax alone (Sampler.greedy_tokens), any other the full sampler."""
        tokens = self.sampler.greedy_tokens(seqs, logits)
        if tokens is not None:
            return self._postprocess(seqs, tokens)
        sampled = self.sampler(seqs, logits)
        return self._postprocess(seqs, [t.token_id for t in sampled], sampled)

    def _postprocess(
        self, seqs: list[Sequence], tokens: list[int], sampled: list[SampledToken] | None = None
    ) -> list[RequestOutput]:
        """Append each row's token (``sampled``, when given, carries its logprobs or its error) and
        build the outputs of the requests touched, in the order first touched. A request of one
        sequence has its output built at once; one of several once all its rows are in, since one
        failing row fails them all. A FINAL_ONLY request has one only once finished or failed, and
        its text detokenised as each sequence finishes, unless it needed it at every step. Runs for
        every sequence of every step: plain locals."""
        requests = self.requests
        outputs: list[RequestOutput] = []
        pending: dict[str, tuple[_Request, int]] = {}  # several sequences: outputs before its output
        failed: dict[str, str] = {}  # request id -> why it alone failed
        for row, seq in enumerate(seqs):
            rid = seq.request_id
            request = requests.get(rid)
            if request is None or seq.status is SequenceStatus.FINISHED or (failed and rid in failed):
                continue
            if request.first_token_time is None:
                request.first_token_time = time.perf_counter()
            token = sampled[row] if sampled is not None else None
            error = token.error if token is not None else None
            if error is None:
                try:
                    if request.text_each_step:
                        self._append(seq, tokens[row], token, request.detokenizers[seq.index])
                    else:
                        self._append_text_later(request, seq, tokens[row], token)
                except Exception as exc:
                    log.exception("post-processing request %s failed; failing it alone", rid)
                    error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                failed[rid] = error
            if len(request.seqs) == 1:
                if error is not None or not request.final_only or seq.status is SequenceStatus.FINISHED:
                    outputs.append(self._settle(request, error))
            elif rid not in pending:
                pending[rid] = (request, len(outputs))
        # Last place first, so each insertion leaves the places before it as they were.
        for rid, (request, place) in reversed(pending.items()):
            error = failed.get(rid)
            if error is not None or not request.final_only or _all_finished(request.seqs):
                outputs.insert(place, self._settle(request, error))
        return outputs

    def _append_text_later(
        self, request: _Request, seq: Sequence, tid: int, token: SampledToken | None
    ) -> None:
        """``_append`` for a sequence whose text nothing reads before it finishes (FINAL_ONLY, no stop
        strings): its text is detokenised once it finishes, by the same calls as at every step."""
        self._append(seq, tid, token, None)
        if seq.status is SequenceStatus.FINISHED:
            _catch_up(seq, request.detokenizers[seq.index])

    def _settle(self, request: _Request, error: str | None) -> RequestOutput:
        """A sampled request's output; a failed one is aborted first, a finished one forgotten."""
        if error is not None:
            self.abort_request(request.request_id)
        output = self._output(request, error)
        if output.finished:
            self.requests.pop(request.request_id, None)
        return output

    def _append(
        self, seq: Sequence, tid: int, token: SampledToken | None, detok: IncrementalDetokenizer | None
    ) -> None:
        """Add a sampled token (``token``: its logprobs, when asked) to its sequence and finish the
        sequence if it should stop (runs for every sequence of every step: plain locals, no properties).
        ``detok``: None when the text is detokenised later (never with stop strings, which read it)."""
        p, ids = seq.params, seq.token_ids
        ids.append(tid)
        if token is not None and token.logprobs is not None:
            for alternative, lp in token.logprobs.items():
                lp.decoded_token = self.token_text(alternative)
            seq.logprobs.append(token.logprobs)
            seq.cumulative_logprob += token.logprob
        constraint = seq.constraint
        if constraint is not None:
            constraint.accept(tid)
        new_text = detok.step(tid) if detok is not None else ""
        if new_text:
            seq.add_text(new_text)
        num_output = len(ids) - len(seq.prompt_token_ids)
        terminated = constraint is not None and constraint.is_terminated()
        eos = not p.ignore_eos and tid in self.eos_token_ids and num_output >= p.min_tokens
        if terminated or eos:
            self._finish(seq, "stop", None)
        elif p.stop_token_ids and tid in p.stop_token_ids and num_output >= p.min_tokens:
            self._finish(seq, "stop", tid)
        elif p.stop and new_text and (hit := _find_stop(seq, len(new_text), p.stop)):
            idx, stop = hit
            seq.cut_text(idx + (len(stop) if p.include_stop_str_in_output else 0))
            self._finish(seq, "stop", stop)
        elif (p.max_tokens is not None and num_output >= p.max_tokens) or len(ids) >= self.max_model_len:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)

    def _output(self, request: _Request, error: str | None = None) -> RequestOutput:
        if error is not None and not request.text_each_step:
            _catch_up_text(request)  # a failed request's text is the text so far, whatever its kind
        seqs = request.seqs
        first = seqs[0]
        hold = 0 if error is not None else request.hold  # a failed request's text: all there is
        completion = _delta if request.delta else _completion
        if len(seqs) == 1:  # most requests: no generator to run
            completions = [completion(first, hold)]
            finished = first.status is SequenceStatus.FINISHED
        else:
            completions = [completion(seq, hold) for seq in seqs]
            finished = _all_finished(seqs)
        scored = first.prompt_logprobs
        if request.delta and scored is not None:
            scored = None if request.prompt_logprobs_sent else scored
            request.prompt_logprobs_sent = True
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            completions,
            finished,
            first.num_cached_tokens,
            list(scored) if scored is not None else None,
            error,
            request.first_token_time,
        )


def _catch_up_text(request: _Request) -> None:
    """Detokenise the tokens of a request whose text was left for later (FINAL_ONLY) that are not yet:
    its sequences stopped without finishing (the request failed). A detokeniser that fails too
    leaves its sequence's text as it was: the request's error is already what its output says."""
    for seq, detok in zip(request.seqs, request.detokenizers, strict=True):
        try:
            _catch_up(seq, detok)
        except Exception:
            log.exception("detokenising the text of failed request %s failed", request.request_id)


def _catch_up(seq: Sequence, detok: IncrementalDetokenizer) -> None:
    """Add to the sequence's text what its generated tokens not yet detokenised make."""
    seq.add_text(detok.catch_up(seq.token_ids[len(seq.prompt_token_ids) :]))


def _find_stop(seq: Sequence, new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """find_stop over the end of the sequence's text that a stop ending in its new characters can
    start in (the whole text is not joined for it)."""
    start = max(0, seq.text_len - new_chars - max(map(len, stops)) + 1)
    hit = find_stop(seq.text_slice(start, seq.text_len), new_chars, stops)
    return None if hit is None else (start + hit[0], hit[1])


def _all_finished(seqs: list[Sequence]) -> bool:
    return all(seq.status is SequenceStatus.FINISHED for seq in seqs)


def stop_hold(params: SamplingParams) -> int:
    """How many characters at the end of a running sequence's text its outputs hold back: a stop
    string may be starting there, and the text up to a stop string is all a client may see of it."""
    if not params.stop or params.include_stop_str_in_output:
        return 0  # with the stop string kept, the text before it is the client's whatever follows
    return max(map(len, params.stop)) - 1


def _text_end(seq: Sequence, hold: int) -> int:
    """Where the text its output shows ends: all of it once the sequence finished, else ``hold``
    characters short (never short of what an output already showed)."""
    text_len = seq.text_len
    if not hold or seq.status is SequenceStatus.FINISHED:
        return text_len
    return max(seq.num_sent_chars, text_len - hold)


def _completion(seq: Sequence, hold: int) -> CompletionOutput:
    """The sequence as its request's CUMULATIVE output reports it now (copies: the sequence goes on
    growing)."""
    logprobs = seq.logprobs
    end = _text_end(seq, hold)
    seq.num_sent_chars = end
    return CompletionOutput(
        seq.index,
        seq.text if end == seq.text_len else seq.text[:end],
        seq.token_ids[len(seq.prompt_token_ids) :],
        seq.cumulative_logprob if logprobs is not None else None,
        list(logprobs) if logprobs is not None else None,
        seq.finish_reason,
        seq.stop_reason,
    )


def _delta(seq: Sequence, hold: int) -> CompletionOutput:
    """What the sequence added since its request's last output (RequestOutputKind.DELTA): slices of
    the new part alone, so an output costs the same however long the sequence has grown."""
    logprobs, sent = seq.logprobs, seq.num_sent_tokens
    end = _text_end(seq, hold)
    text = seq.text_slice(seq.num_sent_chars, end)
    seq.num_sent_chars, seq.num_sent_tokens = end, seq.num_output_tokens
    return CompletionOutput(
        seq.index,
        text,
        seq.token_ids[len(seq.prompt_token_ids) + sent :],
        seq.cumulative_logprob if logprobs is not None else None,
        logprobs[sent:] if logprobs is not None else None,
        seq.finish_reason,
        seq.stop_reason,
    )


def _eos_ids(model_dir: str, tokenizer, generation_config_cls) -> list[int]:
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    try:
        eos = generation_config_cls.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    return ids
