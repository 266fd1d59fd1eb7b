"""LoRA adapters over HTTP, in vLLM's shapes: `--lora-modules`, the adapters in /v1/models, and the
runtime `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (only with
--allow-runtime-lora-updating, like vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).

A request selects an adapter by naming it in ``model``. The adapters themselves are checked and run
by the engine (engine/lora); this module keeps the server's list of names and turns the engine's
refusals into HTTP errors: a bad adapter 400, an unknown one 404, one still in use 409. Loading
reads and checks the adapter in a worker thread while the engine keeps stepping (through the node
cache when the server has a cache socket), then registers it in the engine thread between two steps,
and observes ``keepwarm_lora_load_seconds{source}``. ``load_adapter`` and ``unload_adapter`` are the
one way adapters come and go: the routes here and `--lora-modules-file` (server/openai/lora/file_sync.py) both
use them, under ``ServingContext.lora_lock``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from keepwarm_runtime.server.base.lora_modules import LoraModule
from keepwarm_runtime.server.base.routes import Route
from keepwarm_runtime.server.openai.lora.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

if TYPE_CHECKING:
    from fastapi import Request

    from keepwarm_runtime.server.base.serving import ServingContext

LOAD_ROUTE = "/v1/load_lora_adapter"
UNLOAD_ROUTE = "/v1/unload_lora_adapter"


async def load_adapter(ctx: ServingContext, module: LoraModule) -> None:
    """Read and check ``module`` in a worker thread while steps go on, register it between two steps,
    and let clients name it; LoraLoadError names what is wrong and changes nothing. Callers hold
    ``ctx.lora_lock``, so two loads of one name never race."""
    engine = ctx.async_engine.loaded_engine()
    weights = await asyncio.to_thread(engine.read_lora, module.name, module.path)
    await asyncio.wrap_future(ctx.async_engine.call(lambda e: e.engine.register_lora(weights)))
    ctx.metrics.record_lora_load(weights.source, weights.seconds)
    ctx.loras[module.name] = module


async def unload_adapter(ctx: ServingContext, name: str) -> None:
    """Free the adapter's slot and weights: LoraInUse while unfinished requests name it (nothing
    changes then); one the engine no longer knows is simply forgotten."""
    with contextlib.suppress(KeyError):  # already gone from the engine: forget the name too
        await asyncio.wrap_future(ctx.async_engine.call(lambda e: e.engine.remove_lora(name)))
    ctx.loras.pop(name, None)


async def load_lora_adapter(ctx: ServingContext, req: LoadLoraAdapterRequest, raw: Request) -> Any:
    from fastapi.responses import PlainTextResponse

    from keepwarm_runtime.engine.lora import LoraLoadError
    from keepwarm_runtime.server.base.errors import BadRequest

    async with ctx.lora_lock:
        if req.lora_name in ctx.loras or req.lora_name == ctx.served_model_name:
            message = f"The lora adapter '{req.lora_name}' has already been loaded."
            raise BadRequest(message, param="lora_name")
        try:
            await load_adapter(ctx, LoraModule(req.lora_name, req.lora_path))
        except LoraLoadError as exc:
            raise BadRequest(str(exc), param="lora_path", code="invalid_lora_adapter") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(ctx: ServingContext, req: UnloadLoraAdapterRequest, raw: Request) -> Any:
    from fastapi.responses import PlainTextResponse

    from keepwarm_runtime.engine.lora import LoraInUse
    from keepwarm_runtime.server.base.errors import Conflict, NotFound

    async with ctx.lora_lock:
        if req.lora_name not in ctx.loras:
            raise NotFound(f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name")
        try:
            await unload_adapter(ctx, req.lora_name)
        except LoraInUse as exc:
            raise Conflict(str(exc), param="lora_name", code="lora_adapter_in_use") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


_RUNTIME = "runtime_lora_updating"  # --allow-runtime-lora-updating
ROUTES = (
    Route(LOAD_ROUTE, "POST", load_lora_adapter, body=LoadLoraAdapterRequest, requires=_RUNTIME),
    Route(UNLOAD_ROUTE, "POST", unload_lora_adapter, body=UnloadLoraAdapterRequest, requires=_RUNTIME),
)
