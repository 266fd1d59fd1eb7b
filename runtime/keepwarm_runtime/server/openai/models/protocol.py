"""GET /v1/models and /v1/models/{id} shapes: a model card (the served model or a LoRA adapter), the list."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "keepwarm"
    root: str | None = None  # the model directory (a LoRA adapter's: its directory)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
