"""What the server needs from an engine: the ``EngineClient`` protocol, the one type at that boundary.

``LLMEngine`` and ``WhisperEngine`` satisfy it; tests may pass any object that does. The server asks
the engine about the model (vocabulary width, EOS ids, token texts) instead of re-reading checkpoint
files, so the two can never disagree, and reads what else it offers (LoRA, start-up profile, MoE
backends, transcription, audio input) from its ``capabilities`` (engine/capabilities.py), never by
probing. A request's audio crosses as ``AudioFeatures`` (the feature extractor's output); the engine
runs its audio encoder itself, so the server never touches the engine's model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from keepwarm_runtime.engine.capabilities import EngineCapabilities
    from keepwarm_runtime.engine.loader import LoadInfo
    from keepwarm_runtime.engine.multimodal import AudioFeatures
    from keepwarm_runtime.engine.outputs import EngineStats, RequestOutput
    from keepwarm_runtime.engine.sampling_params import SamplingParams


class EngineClient(Protocol):
    tokenizer: Any  # a transformers tokenizer (PreTrainedTokenizerBase)
    max_model_len: int  # prompt + output tokens per sequence
    vocab_size: int  # the logits width (may exceed len(tokenizer): padded lm_head)
    eos_token_ids: set[int]  # ids that end a sequence
    max_prompt_logprobs_len: int  # longest prompt it scores (prompt logprobs); 0: none
    load_info: LoadInfo  # where the weights came from and how long it took
    capabilities: EngineCapabilities  # what it offers beyond generating tokens

    def token_text(self, token_id: int) -> str:
        """One token's text as a client reads it."""

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        audio: AudioFeatures | None = None,
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def work_while_idle(self) -> bool:
        """One piece of the work an engine does between requests (capturing a decode graph); False
        when there is none left. The server calls it while no request runs, checking for new ones
        between pieces."""

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> EngineStats: ...
