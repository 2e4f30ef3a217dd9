"""The error a client sees: one exception type, rendered in OpenAI's error shape."""
from __future__ import annotations

from typing import Any

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "internal_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error the client sees as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


class BrokerUnavailable(Exception):
    """The broker cannot be reached."""
