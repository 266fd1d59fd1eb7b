"""``Route``: how a route group declares its routes; app.py registers every group's from one list.

A group's module exposes ``ROUTES: tuple[Route, ...]``. Handlers without a body model are FastAPI
endpoints that find the server's state on ``request.app.state`` (``ctx``, ``sleep_mode``,
``audio_settings``, ``audio_metrics``); handlers with one are called ``handler(ctx, body, raw)``.
Standard library only, so light modules (settings, the LoRA list) can declare routes too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

Option = Literal["sleep_mode", "runtime_lora_updating"]


@dataclass(frozen=True)
class Route:
    path: str  # FastAPI path template, e.g. "/v1/models/{model_id:path}"
    method: Literal["GET", "POST"]
    handler: Callable[..., Awaitable[Any]]  # a FastAPI endpoint, or handler(ctx, body, raw) with ``body``
    # The JSON body's pydantic model: the app parses it (503 before ready, then 400 if invalid), publishes
    # its schema in /openapi.json, and sleep mode admits the request; None: the handler reads the request.
    body: type[Any] | None = None
    inference: bool = False  # the engine generates for it: counted in keepwarm_active_requests
    own_body_limit: bool = False  # the handler caps its own upload (multipart), not --max-request-body-bytes
    requires: Option | None = None  # registered only when the server runs with this option
