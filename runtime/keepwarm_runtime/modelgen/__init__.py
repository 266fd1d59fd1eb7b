"""Random-weight Hugging Face checkpoints for tests, benchmarks and the demo (no hub access)."""

from keepwarm_runtime.modelgen.checkpoint import make_model, parse_param_count
from keepwarm_runtime.modelgen.tokenizer import build_tokenizer

__all__ = ["build_tokenizer", "make_model", "parse_param_count"]
