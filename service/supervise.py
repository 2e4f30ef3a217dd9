"""Background tasks that cannot die silently: a loop that raises is logged and restarted."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


def supervised(name: str, body: Callable[[], Awaitable[None]], restart_s: float) -> asyncio.Task:
    """Runs ``body`` as a task; on any exception (a bug, an unexpected reply) logs it and runs it again
    after ``restart_s``: a gateway whose reader or watcher stopped would hang every stream."""
    async def guard() -> None:
        while True:
            try:
                await body()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background task %s failed; restarting it in %.2f s", name, restart_s)
                await asyncio.sleep(restart_s)
    return asyncio.create_task(guard(), name=name)
