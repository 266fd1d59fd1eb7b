"""/openapi.json with the request models: routes parse their own bodies (size, depth and Unicode
checks first), so FastAPI cannot see the models; this puts them back for generated clients and
schema fuzzers."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is ``model``."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        }
    }


def component_schemas(models: list[type[BaseModel]]) -> dict[str, Any]:
    """Each model's JSON schema plus its nested definitions, flattened into one components map."""
    schemas: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template=REF, mode="validation")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            spec.setdefault("components", {}).setdefault("schemas", {}).update(component_schemas(models))
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
