"""keepwarm runtime: node weight cache, inference engine, OpenAI-compatible server.

`from keepwarm_runtime import LLM, SamplingParams` loads the engine on first use, so a plain
`import keepwarm_runtime` (the CLI, the cache daemon) stays light and never imports torch.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "keepwarm_runtime.engine.llm",
    "SamplingParams": "keepwarm_runtime.engine.sampling_params",
    "RequestOutputKind": "keepwarm_runtime.engine.sampling_params",
    "EngineConfig": "keepwarm_runtime.engine.config",
    "LLMEngine": "keepwarm_runtime.engine.llm_engine",
    "RequestOutput": "keepwarm_runtime.engine.outputs",
    "CompletionOutput": "keepwarm_runtime.engine.outputs",
    "LoRARequest": "keepwarm_runtime.engine.llm",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'keepwarm_runtime' has no attribute {name!r}")
