"""Typed API errors and their OpenAI-shaped bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from keepwarm_runtime.engine.outputs import internal_error
from keepwarm_runtime.server.base.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error the client should see as-is; ``status`` picks the HTTP status."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class BadRequest(APIError):
    """400: invalid parameters, malformed JSON, a prompt longer than the context."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(APIError):
    """401: --api-key is set and the request's Bearer token is missing or wrong."""

    status = 401
    type = "authentication_error"


class Conflict(APIError):
    """409: the request contradicts the server's state (POST /sleep while requests run, unloading a LoRA
    adapter requests still use)."""

    status = 409
    type = "invalid_request_error"


class PayloadTooLarge(APIError):
    """413: the body is larger than --max-request-body-bytes, or an audio upload or fetched audio_url
    is over --max-audio-upload-bytes."""

    status = 413
    type = "invalid_request_error"


class ModelNotFound(APIError):
    """404: the request names a model this server does not serve."""

    status = 404
    type = "invalid_request_error"

    def __init__(self, model: str, served: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist; this server serves `{served}`.",
            param="model",
            code="model_not_found",
        )


class NotFound(APIError):
    """404: the request names something else this server does not have (a LoRA adapter to unload)."""

    status = 404
    type = "NotFoundError"


class NotReady(APIError):
    """503: weights are still loading (or failed to load)."""

    status = 503
    type = "service_unavailable_error"


class ClientClosedRequest(APIError):
    """499 (nginx's convention): the client went away first; nobody reads it, metrics count it apart."""

    status = 499
    type = "client_closed_request"


def from_validation_error(exc: ValidationError | RequestValidationError) -> BadRequest:
    """A 400 naming the first offending field, e.g. ``temperature: Input should be <= 2``."""
    errors = exc.errors()
    if not errors:
        return BadRequest("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return BadRequest(f"malformed JSON body: {first.get('msg')}", code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return BadRequest(message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Every error, including unknown routes and crashes, leaves as an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(exc.detail), code=str(exc.status_code))
        err.status = exc.status_code
        err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return exc_response(err, exc.headers)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        return APIError(internal_error(exc)).response()


def exc_response(err: APIError, headers: dict[str, str] | None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)
