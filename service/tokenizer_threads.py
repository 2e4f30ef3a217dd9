"""The tokenizer's work, off the event loop: tokenizing a long prompt takes milliseconds, detokenizing a busy
server's streams as much, and the loop must keep answering. Each tenant gets its turn at the threads
(``service.fair_pool``); one tenant's queue of admission work is bounded like the engines' (429 past
``max_pending_requests``)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from service.config import GatewayConfig
from service.errors import APIError
from service.fair_pool import FairPool, PoolFull
from service.tenancy import Tenancy

T = TypeVar("T")


class TokenizerThreads:
    def __init__(self, config: GatewayConfig, tokenizer: PreTrainedTokenizerBase, tenancy: Tenancy) -> None:
        threads = config.tokenizer_threads or (2 if tokenizer.is_fast else 1)
        self._pool = FairPool(threads, config.max_pending_requests)
        self._tenancy = tenancy
        self._retry_after_s = config.retry_after_s

    async def run(self, http: web.Request, fn: Callable[..., T], *args: Any, bounded: bool = False) -> T:
        """``fn(*args)`` on the threads, in the turn of ``http``'s tenant; ``bounded`` (work that admits a
        new request): a 429 rather than a tenant queue longer than ``max_pending_requests``."""
        try:
            return await self._pool.run(self._tenancy.share_of(http), fn, *args, bounded=bounded)
        except PoolFull as exc:
            raise APIError(429, f"{exc}; retry later", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self._retry_after_s)}) from None

    def shutdown(self) -> None:
        self._pool.shutdown()
