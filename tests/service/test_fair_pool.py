"""The tokenizer threads' fair sharing (service.fair_pool): tenants take turns, no tenant holds every thread,
one tenant's queue is bounded, a job whose caller left never runs, and errors reach the caller. Jobs block
on events the test sets, so what runs when is decided by the test, not by timing."""
from __future__ import annotations

import asyncio
import threading

import pytest

from service.fair_pool import FairPool, PoolFull


class Jobs:
    """Jobs that record their start and wait to be released, one event each."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.release: dict[str, threading.Event] = {}

    def job(self, name: str) -> tuple:
        self.release[name] = threading.Event()
        return (self._run, name)

    def _run(self, name: str) -> str:
        self.started.append(name)
        assert self.release[name].wait(10)
        return name


async def until_started(jobs: Jobs, count: int) -> None:
    while len(jobs.started) < count:
        await asyncio.sleep(0.001)


async def test_tenants_take_turns_on_one_thread() -> None:
    pool, jobs = FairPool(threads=1, max_queued=100), Jobs()
    flood = [asyncio.create_task(pool.run("flood", *jobs.job(f"f{i}"))) for i in range(5)]
    await until_started(jobs, 1)
    other = asyncio.create_task(pool.run("other", *jobs.job("o")))
    await asyncio.sleep(0)
    for k, name in enumerate(["f0", "o", "f1", "f2", "f3", "f4"]):
        await until_started(jobs, k + 1)
        jobs.release[jobs.started[k]].set()
    assert await other == "o" and [await f for f in flood] == [f"f{i}" for i in range(5)]
    assert jobs.started == ["f0", "o", "f1", "f2", "f3", "f4"]  # the other tenant waited one job, not five
    pool.shutdown()


async def test_one_tenant_never_holds_every_thread() -> None:
    pool, jobs = FairPool(threads=2, max_queued=100), Jobs()
    flood = [asyncio.create_task(pool.run("flood", *jobs.job(f"f{i}"))) for i in range(3)]
    await until_started(jobs, 1)
    other = asyncio.create_task(pool.run("other", *jobs.job("o")))
    await until_started(jobs, 2)
    assert jobs.started == ["f0", "o"]  # the second thread was free for the other tenant
    jobs.release["o"].set()
    assert await other == "o" and jobs.started == ["f0", "o"]  # the flood still runs one job at a time
    for name in ("f0", "f1", "f2"):
        jobs.release[name].set()
    assert [await f for f in flood] == ["f0", "f1", "f2"]
    pool.shutdown()


async def test_a_tenants_queue_is_bounded_for_admission_work_only() -> None:
    pool, jobs = FairPool(threads=1, max_queued=2), Jobs()
    running = asyncio.create_task(pool.run("t", *jobs.job("run")))
    await until_started(jobs, 1)
    queued = [asyncio.create_task(pool.run("t", *jobs.job(f"q{i}"), bounded=True)) for i in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(PoolFull):
        await pool.run("t", *jobs.job("refused"), bounded=True)
    admitted = asyncio.create_task(pool.run("t", *jobs.job("stream")))  # an admitted stream's work waits
    await asyncio.sleep(0)
    assert pool.num_waiting == 3
    for name in ("run", "q0", "q1", "stream"):
        jobs.release[name].set()
    assert [await t for t in (running, *queued, admitted)] == ["run", "q0", "q1", "stream"]
    assert "refused" not in jobs.started
    pool.shutdown()


async def test_a_job_whose_caller_left_never_runs_and_errors_reach_the_caller() -> None:
    pool, jobs = FairPool(threads=1, max_queued=10), Jobs()
    running = asyncio.create_task(pool.run("t", *jobs.job("run")))
    await until_started(jobs, 1)
    left = asyncio.create_task(pool.run("t", *jobs.job("left")))
    await asyncio.sleep(0)
    left.cancel()
    jobs.release["run"].set()
    assert await running == "run"

    def broken() -> None:
        raise ValueError("bad template")

    with pytest.raises(ValueError, match="bad template"):
        await pool.run("t", broken)
    assert jobs.started == ["run"]
    pool.shutdown()
