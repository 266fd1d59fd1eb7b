"""`--lora-modules-file`: the LoRA adapters a server serves, kept in step with a file while it runs.

The operator writes an InferenceDeployment's adapters into a ConfigMap its pods mount
(keepwarm_api.paths.LORA_LIST_MOUNT); when the list changes the kubelet swaps the file in place (an
atomic symlink swap, within its sync period), and this loop, reading the file every POLL_S, makes the
served set match it, with no restart:
- an added adapter loads as through POST /v1/load_lora_adapter (server/openai/lora/serving.py);
- a removed one leaves ``model`` at once (new requests get 404) and is unloaded once no unfinished
  request uses it, so weights in use are never freed; a changed path is a removal, then an addition;
- an entry that cannot be served (a bad adapter, a name --lora-modules, the runtime routes or the base
  model already hold) is logged by name, counted in ``keepwarm_lora_adapter_refused{adapter}`` and
  tried again every RETRY_S or when the file changes (its files may still be on their way);
- a file that cannot be read or parsed leaves the served set as it was, logged once per content.
The first pass runs before /ready answers 200, so a pod is Ready with the adapters it lists. Adapters
loaded otherwise (--lora-modules, the runtime routes) are never unloaded by the file.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from keepwarm_runtime.server.base.lora_modules import LoraModule, parse_lora_modules_file
from keepwarm_runtime.server.openai.lora.serving import load_adapter, unload_adapter

if TYPE_CHECKING:
    from keepwarm_runtime.server.base.serving import ServingContext

log = logging.getLogger(__name__)
POLL_S = 1.0  # how often the file is read: a kubelet updates it within a minute, this adds a second
RETRY_S = 10.0  # how often a refused entry is tried again while the file stays the same
ENGINE_POLL_S = 0.05  # how often the first pass looks whether the engine has loaded


@dataclass
class Refusal:
    reason: str
    at: float  # monotonic time of the try
    text: str  # the file's content then


@dataclass
class LoraFileSync:
    """The adapters ``path`` lists, applied to a serving context (``run`` is its task)."""

    path: Path
    owned: dict[str, LoraModule] = field(default_factory=dict)  # loaded from the file, in ``model``
    leaving: dict[str, LoraModule] = field(default_factory=dict)  # out of ``model``, unloading once idle
    refused: dict[str, Refusal] = field(default_factory=dict)
    synced: asyncio.Event = field(default_factory=asyncio.Event)  # the first pass is done
    _text: str | None = None  # the content last read
    _listed: tuple[LoraModule, ...] = ()  # what the last content that parsed lists
    _bad_text: str | None = None  # the last content that did not parse (logged once)

    async def run(self, ctx: ServingContext) -> None:
        """Wait for the engine, then sync every POLL_S until cancelled; a failing pass is logged and
        the next one tries again (this task never ends the server)."""
        engine = ctx.async_engine
        while not engine.ready_event.is_set():
            await asyncio.sleep(ENGINE_POLL_S)
        if engine.state == "failed":
            return
        while True:
            try:
                await self.sync(ctx)
            except Exception:
                log.exception("--lora-modules-file %s: a sync pass failed; retrying", self.path)
            self.synced.set()
            await asyncio.sleep(POLL_S)

    async def sync(self, ctx: ServingContext) -> None:
        """One pass: read the file, then unload what left it and load what joined it."""
        self._read()
        listed = {m.name: m for m in self._listed}
        async with ctx.lora_lock:
            for name, module in list(self.leaving.items()):
                if listed.get(name) == module:  # listed again before it could unload: serve it on
                    ctx.loras[name] = self.owned[name] = self.leaving.pop(name)
            for name, module in list(self.owned.items()):
                if ctx.loras.get(name) is not module:  # unloaded through the runtime route
                    del self.owned[name]
                elif listed.get(name) != module:
                    ctx.loras.pop(name, None)  # no new request may name it
                    self.leaving[name] = self.owned.pop(name)
            await self._unload_idle(ctx)
            for name, module in listed.items():
                if name not in self.owned and name not in self.leaving and self._due(name):
                    await self._load(ctx, module)
        for name in set(self.refused) - set(listed):
            del self.refused[name]
        ctx.metrics.record_lora_refused(tuple(self.refused))

    def _read(self) -> None:
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            text = f"<unreadable: {exc}>"
            if text != self._bad_text:
                log.error("--lora-modules-file %s cannot be read (%s); serving on as before", self.path, exc)
                self._bad_text = text
            return
        if text == self._text:
            return
        self._text = text
        try:
            self._listed = parse_lora_modules_file(text, str(self.path))
        except ValueError as exc:
            if text != self._bad_text:
                log.error("%s; serving on as before", exc)
                self._bad_text = text
            return
        names = ", ".join(m.name for m in self._listed) or "none"
        log.info("--lora-modules-file %s lists %s", self.path, names)

    async def _unload_idle(self, ctx: ServingContext) -> None:
        from keepwarm_runtime.engine.lora import LoraInUse

        for name in list(self.leaving):
            try:
                await unload_adapter(ctx, name)
            except LoraInUse:
                continue  # its requests finish first; the next pass tries again
            log.info("LoRA adapter %r unloaded: --lora-modules-file no longer lists it as it was", name)
            del self.leaving[name]

    def _due(self, name: str) -> bool:
        """Whether to try an entry: not refused, or refused for an older content or RETRY_S ago."""
        refusal = self.refused.get(name)
        return refusal is None or refusal.text != self._text or time.monotonic() - refusal.at >= RETRY_S

    async def _load(self, ctx: ServingContext, module: LoraModule) -> None:
        from keepwarm_runtime.engine.lora import LoraLoadError

        if module.name == ctx.served_model_name:
            return self._refuse(module.name, "it is the served model's name")
        if module.name in ctx.loras:
            return self._refuse(module.name, "--lora-modules or /v1/load_lora_adapter already serves it")
        try:
            await load_adapter(ctx, module)
        except LoraLoadError as exc:
            return self._refuse(module.name, str(exc))
        log.info("LoRA adapter %r loaded from %s (--lora-modules-file)", module.name, module.path)
        self.owned[module.name] = module
        self.refused.pop(module.name, None)

    def _refuse(self, name: str, reason: str) -> None:
        previous = self.refused.get(name)
        if previous is None or previous.reason != reason:
            log.error("--lora-modules-file %s: LoRA adapter %r not served: %s", self.path, name, reason)
        self.refused[name] = Refusal(reason, time.monotonic(), self._text or "")
