"""LoRA adapters on a warm base: PEFT adapters checked at load (adapter.py), batched per token (slots.py)."""

from keepwarm_runtime.engine.lora.adapter import LoraLoadError
from keepwarm_runtime.engine.lora.slots import LoraInUse, LoraSlots

__all__ = ["LoraInUse", "LoraLoadError", "LoraSlots"]
