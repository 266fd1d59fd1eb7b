"""app.ROUTES derives from the route groups' declarations: each path once, the inference set and the
option-gated routes as the groups declare them."""

from __future__ import annotations

from pathlib import Path

from keepwarm_runtime.server import app
from keepwarm_runtime.server.base.serving import ServingOptions

GENERATING = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
}
GATED = {"/sleep", "/wake_up", "/is_sleeping", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}


def _paths(tmp_path: Path, **kwargs: object) -> set[str]:
    built = app.create_app(lambda: None, model_dir=tmp_path, **kwargs)  # type: ignore[arg-type, return-value]
    return {route.path for route in built.routes}


def test_every_path_is_declared_once_and_the_generating_ones_count_as_inference():
    assert len(set(app.ROUTES)) == len(app.ROUTES)
    assert app.INFERENCE_ROUTES == GENERATING
    assert {"/v1/audio/transcriptions", "/v1/audio/translations"} == app.OWN_BODY_LIMIT


def test_option_gated_routes_exist_only_with_their_option(tmp_path: Path):
    plain = _paths(tmp_path)
    assert set(app.ROUTES) - GATED <= plain and not plain & GATED
    everything = _paths(tmp_path, sleep_mode=True, options=ServingOptions(allow_runtime_lora_updating=True))
    assert set(app.ROUTES) <= everything
