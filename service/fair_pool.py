"""The gateway's tokenizer threads, shared fairly: each tenant's jobs wait in a queue of their own, a free
thread takes the job of the tenant served least recently (a tenant new to the queue first), and no tenant
runs on more than ``threads - 1`` of them at once (one with a single thread). So one tenant's flood of long prompts never delays another tenant by the flood's length:
with two or more threads a second tenant finds a thread free, with one it waits for one job at most. A
tenant may have at most ``max_queued`` jobs waiting for admission work (tokenizing a prompt); work for a
request already admitted (detokenizing its stream) always waits its turn instead of failing."""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")


class PoolFull(Exception):
    """The tenant already has ``max_queued`` jobs waiting."""


@dataclass(slots=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    result: asyncio.Future[Any]


class FairPool:
    def __init__(self, threads: int, max_queued: int, thread_name_prefix: str = "tokenize") -> None:
        self._threads = threads
        self._max_queued = max_queued
        self._max_running = max(1, threads - 1)  # per tenant: a thread stays free for the others
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=thread_name_prefix)
        self._waiting: dict[str, deque[_Job]] = {}  # tenant -> its jobs not started yet
        self._running: dict[str, int] = {}  # tenant -> its jobs on the threads
        self._served: dict[str, int] = {}  # tenant with jobs -> when it was last given a thread (a count)
        self._clock = 0

    @property
    def num_waiting(self) -> int:
        return sum(len(jobs) for jobs in self._waiting.values())

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any, bounded: bool = False) -> T:
        """``fn(*args)`` on a thread, in ``tenant``'s turn; ``bounded``: PoolFull rather than a long queue."""
        jobs = self._waiting.get(tenant)
        if bounded and jobs is not None and len(jobs) >= self._max_queued:
            raise PoolFull(f"{len(jobs)} jobs of this tenant are waiting for the tokenizer")
        job = _Job(fn, args, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(tenant, deque()).append(job)
        self._dispatch()
        return await job.result

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _dispatch(self) -> None:
        while sum(self._running.values()) < self._threads and (tenant := self._next_tenant()) is not None:
            job = self._take(tenant)
            if job.result.cancelled():  # its caller left while it waited: no thread time for it
                self._forget_if_idle(tenant)
                continue
            self._running[tenant] = self._running.get(tenant, 0) + 1
            done = self._executor.submit(job.fn, *job.args)
            # Called on the pool's thread: the bookkeeping goes back to the event loop's.
            done.add_done_callback(partial(job.result.get_loop().call_soon_threadsafe, self._finish, tenant, job))

    def _next_tenant(self) -> str | None:
        """The tenant served least recently among those with a job waiting and a thread to spare."""
        ready = [t for t in self._waiting if self._running.get(t, 0) < self._max_running]
        return min(ready, key=lambda t: self._served.get(t, -1), default=None)

    def _take(self, tenant: str) -> _Job:
        """The tenant's oldest job."""
        jobs = self._waiting[tenant]
        job = jobs.popleft()
        if not jobs:
            del self._waiting[tenant]
        self._clock += 1
        self._served[tenant] = self._clock
        return job

    def _forget_if_idle(self, tenant: str) -> None:
        """A tenant with no job left comes back as a newcomer (and the maps hold active tenants only)."""
        if tenant not in self._waiting and tenant not in self._running:
            self._served.pop(tenant, None)

    def _finish(self, tenant: str, job: _Job, done: Future[Any]) -> None:
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]
        self._forget_if_idle(tenant)
        if done.cancelled():  # the pool shut down
            job.result.cancel()
        elif not job.result.cancelled():
            if (error := done.exception()) is not None:
                job.result.set_exception(error)
            else:
                job.result.set_result(done.result())
        self._dispatch()
