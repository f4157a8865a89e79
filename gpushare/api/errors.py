"""API errors: one exception type, rendered in Ollama's shape on /api/*, Anthropic's on /v1/messages
and OpenAI's on the rest of /v1/*.

Ollama answers ``{"error": "message"}``; OpenAI answers
``{"error": {"message", "type", "param", "code"}}``; Anthropic ``{"type": "error", "error": {"type",
"message"}}``. Handlers raise ApiError (or let a
registry error through) and the middleware picks the shape from the request path.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

from gpushare.residency.registry import ModelLoadError, ModelNotFound, RegistryFull

log = logging.getLogger("gpushare.api")

_OPENAI_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 503: "server_error", 500: "server_error"}


class ApiError(Exception):
    """An HTTP error with a message meant for the client."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def from_registry_error(e: Exception) -> ApiError:
    """Map the registry's exceptions (engine layer, no HTTP) onto HTTP statuses."""
    if isinstance(e, ModelNotFound):
        return ApiError(404, str(e), param="model", code="model_not_found")
    if isinstance(e, RegistryFull):
        return ApiError(503, str(e), retry_after_s=e.retry_after_s)
    if isinstance(e, ModelLoadError):
        if e.refused:  # the model's files were refused as data: nothing the node can retry
            return ApiError(422, str(e), param="model", code="model_file_refused")
        return ApiError(500, str(e), code="model_load_failed")
    raise TypeError(f"not a registry error: {e!r}")


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/")


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, err: ApiError) -> dict:
    if is_anthropic_path(path):  # Anthropic's error object
        kind = _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}
    if is_openai_path(path):
        kind = _OPENAI_TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
        return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}
    return {"error": err.message}


def error_response(path: str, err: ApiError) -> web.Response:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else {}
    if err.status == 401:  # RFC 9110: a 401 names the scheme it wants
        headers["WWW-Authenticate"] = 'Bearer realm="gpushare"'
    return web.Response(status=err.status, text=json.dumps(error_body(path, err)),
                        content_type="application/json", headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Turn every failure into a JSON error in the dialect of the path; log the unexpected ones."""
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(request.path, e)
    except (ModelNotFound, RegistryFull, ModelLoadError) as e:
        return error_response(request.path, from_registry_error(e))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = f"{request.method} {request.path}: {e.reason.lower()}"
        return error_response(request.path, ApiError(e.status, message))
    except Exception:  # a bug; the client gets JSON without its details (they may name files or other
        # requests' data), the log gets the traceback
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(request.path, ApiError(500, "internal error; the daemon's log has the details"))
