"""What a wake-up costs this machine: CPU time per iteration of a loop that sleeps between its pieces of work,
against the same loop back to back (the reply path's per-step costs, issue 11 point 7).

    python -m loadtest.bench_wakeups [--gap-ms 8.5] [--iterations 300]

Each row is one loop on the main thread, its CPU time (``time.thread_time``) per iteration, without a gap
and with a ``--gap-ms`` sleep between iterations: a plain ``time.sleep``; an ``asyncio.sleep`` on uvloop (one
event-loop wake-up); a redis-py pipeline of two 8 KB XADDs against a private redis-server (a worker's
publish); the same two XADDs on the worker's step lane (``service.step_lane``: one blocking connection, the
commands in one buffer, replies read after the write returns); ``run_in_executor`` of a 0.5 ms sleep (the
worker's step hand-off, which on the step lane a step after a short one no longer pays). On bare metal a wake-up costs
a few microseconds; on a virtual machine that idles its vCPUs it can cost far more, and a worker that
sleeps between steps pays it several times a step.
"""
from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import uvloop


async def cpu_per_iteration(work: Callable[[], Awaitable[None]], iterations: int, gap_s: float) -> float:
    """Microseconds of this thread's CPU per iteration of ``work``, each followed by a ``gap_s`` sleep."""
    await work()  # connections and threads made before timing
    start = time.thread_time()
    for _ in range(iterations):
        await work()
        if gap_s:
            await asyncio.sleep(gap_s)
    return (time.thread_time() - start) / iterations * 1e6


async def main(args: argparse.Namespace) -> None:
    from service.broker import connect
    from service.config import RedisConfig
    from service.local_stack import LocalStack
    from service.step_lane import StepLane

    stack = LocalStack().start()
    config = RedisConfig(url=stack.redis_url, prefix="wakeups")
    client, lane = connect(config), StepLane(config, retry_s=0.5)
    executor, loop = ThreadPoolExecutor(1), asyncio.get_running_loop()
    payload = b"x" * 8000

    async def nothing() -> None:
        pass

    async def plain_sleep() -> None:
        time.sleep(args.gap_ms / 1000)

    async def publish() -> None:
        pipe = client.pipeline(transaction=False)
        for stream in ("s1", "s2"):
            pipe.xadd(stream, {"b": payload}, maxlen=1000, approximate=True)
        await pipe.execute()

    async def on_lane() -> None:
        lane.send([("XADD", stream, "MAXLEN", "~", 1000, "*", "b", payload) for stream in ("s1", "s2")])
        lane.receive()

    async def hand_off() -> None:
        await loop.run_in_executor(executor, time.sleep, 0.0005)

    rows = [("time.sleep (the gap itself)", plain_sleep, 0.0), ("asyncio.sleep on uvloop", nothing, None),
            ("redis-py pipeline, 2 XADDs", publish, None), ("step lane, 2 XADDs", on_lane, None),
            ("run_in_executor, 0.5 ms", hand_off, None)]
    try:
        print(f"{'loop':32} {'back to back':>14} {f'{args.gap_ms} ms apart':>14}  (µs of CPU per iteration)")
        for label, work, gap in rows:
            tight = await cpu_per_iteration(work, args.iterations, 0.0) if gap is None else None
            spaced = await cpu_per_iteration(work, args.iterations, args.gap_ms / 1000 if gap is None else gap)
            print(f"{label:32} {'' if tight is None else f'{tight:.0f}':>14} {spaced:>14.0f}")
    finally:
        await client.aclose()
        lane.close()
        executor.shutdown()
        stack.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gap-ms", type=float, default=8.5, help="the sleep between iterations (a step's time)")
    parser.add_argument("--iterations", type=int, default=300)
    uvloop.run(main(parser.parse_args()))
