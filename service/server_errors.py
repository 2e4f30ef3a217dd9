"""The gateway's answers for what is not the client's fault: a 503 worth retrying soon, and a 500 that is
logged with its cause while the client sees only an id to quote."""
from __future__ import annotations

import logging
import uuid

from service.errors import APIError

log = logging.getLogger(__name__)


def unavailable(message: str, retry_after_s: int) -> APIError:
    """A 503 worth retrying soon (no engine, Redis unreachable, a deadline passed)."""
    return APIError(503, message, code="service_unavailable", headers={"Retry-After": str(retry_after_s)})


def internal_error(what: str, request_id: str | None = None, code: str = "internal_error",
                   with_traceback: bool = True) -> APIError:
    """A 500: logged with ``what`` (and the traceback being handled), while the client sees only an
    id to quote, never the exception's text."""
    request_id = request_id or f"err-{uuid.uuid4().hex}"
    log.error("%s (request id %s)", what, request_id, exc_info=with_traceback)
    return APIError(500, f"internal server error (request id {request_id})", code=code,
                    headers={"X-Request-Id": request_id})
