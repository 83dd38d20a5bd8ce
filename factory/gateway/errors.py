"""Error bodies in each provider's own format, so SDKs raise their usual exception types.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``; Anthropic: ``{"type": "error",
"error": {"type", "message"}}``; Gemini (Google APIs): ``{"error": {"code", "message",
"status"}}``. OTLP and the gateway's own routes use the OpenAI shape.
"""

from __future__ import annotations

import orjson

# status -> (OpenAI type, Anthropic type, Google status)
_KINDS: dict[int, tuple[str, str, str]] = {
    400: ("invalid_request_error", "invalid_request_error", "INVALID_ARGUMENT"),
    401: ("authentication_error", "authentication_error", "UNAUTHENTICATED"),
    403: ("permission_error", "permission_error", "PERMISSION_DENIED"),
    404: ("not_found_error", "not_found_error", "NOT_FOUND"),
    405: ("invalid_request_error", "invalid_request_error", "INVALID_ARGUMENT"),
    413: ("invalid_request_error", "request_too_large", "INVALID_ARGUMENT"),
    500: ("server_error", "api_error", "INTERNAL"),
    502: ("server_error", "api_error", "UNAVAILABLE"),
    503: ("server_error", "overloaded_error", "UNAVAILABLE"),
    504: ("timeout", "api_error", "DEADLINE_EXCEEDED"),
}


def error_body(provider: str, status: int, message: str, *, code: str | None = None) -> bytes:
    """The JSON error body ``provider``'s SDK expects for ``status``."""
    openai_type, anthropic_type, google_status = _KINDS.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", "api_error",
                 "UNKNOWN"))
    if provider == "anthropic":
        return orjson.dumps({"type": "error",
                             "error": {"type": anthropic_type, "message": message}})
    if provider == "gemini":
        return orjson.dumps({"error": {"code": status, "message": message,
                                       "status": google_status}})
    return orjson.dumps({"error": {"message": message, "type": openai_type, "param": None,
                                   "code": code}})
