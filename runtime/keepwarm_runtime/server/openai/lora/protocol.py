"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter bodies (vLLM's): unknown fields are refused."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; adapters are keyed by name here
