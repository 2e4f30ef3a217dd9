"""The engine's model executor: a plain ``ModelRunner`` for one device, or, with ``tensor_parallel_size > 1``,
a ``ModelExecutor`` (rank 0) driving ``tp - 1`` spawned worker processes. Both have ``execute(scheduler_output)
-> logits``; the scheduler and its KV manager never know about ranks."""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import socket
import threading
import weakref
from functools import partial
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cuda_ext
from engine.config import EngineConfig
from engine.core.scheduler_output import SchedulerOutput
from engine.demo_model import ensure_demo_model
from engine.distributed.parallel_state import TensorParallel, init_tensor_parallel, set_rank_threads
from engine.distributed.plan import send_plan
from engine.distributed.worker import run_worker
from engine.loader import load_model
from engine.model_runner import Logits, ModelRunner
from engine.models import model_class
from engine.models.config import read_model_config
from engine.resolved_config import ResolvedConfig, resolve_config

logger = logging.getLogger(__name__)

# A worker that died gives rank 0 this long to raise its own, clearer, error (e.g. a bad checkpoint both
# fail to load) before the watchdog ends the process; a failed step waits as long for a dying worker's
# exit code.
_GRACE_S = 2.0
_JOIN_S = 10.0


def create_executor(config: EngineConfig) -> tuple[ResolvedConfig, ModelRunner | ModelExecutor]:
    """Resolve ``config``, load the model (this rank's shard) and return what runs the steps."""
    # built here, once, before any worker loads it
    ops = cuda_ext.load_ops(config.attention_backend, config.attention_kernel)
    load = partial(load_model, ops=ops, quantization=config.quantization,
                   quantization_group_size=config.quantization_group_size, show_progress=config.show_progress)
    if config.tensor_parallel_size == 1:
        resolved, model = resolve_config(config, load)
        return resolved, ModelRunner(model, resolved, ops)
    _check_shardable(config)
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine already runs in this process (one at a time: shut it down "
                           "with engine.runner.shutdown() or drop it first)")
    return _start_group(config, ops, load)


def _start_group(config: EngineConfig, ops: cuda_ext.KernelOps, load: partial) -> tuple[ResolvedConfig, ModelExecutor]:
    """Spawn ranks 1..N-1, join them as rank 0 and load rank 0's shard (the workers load theirs meanwhile)."""
    size = config.tensor_parallel_size
    set_rank_threads(config.num_threads, size)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.get_context("spawn")
    workers = [context.Process(target=run_worker, args=(rank, config, init_method), daemon=True,
                               name=f"pagedserve-tp{rank}") for rank in range(1, size)]
    for worker in workers:
        worker.start()
    watchdog = Watchdog(workers)
    try:
        tp = init_tensor_parallel(0, size, init_method, TensorParallel(0, size).device(config.device))
        resolved, model = resolve_config(config, partial(load, tp=tp), tp)
        runner = ModelRunner(model, resolved, ops)
    except BaseException:
        watchdog.stop()
        _kill(workers)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return resolved, ModelExecutor(runner, tp, workers, watchdog)


class ModelExecutor:
    """Rank 0 of a tensor-parallel group: plans each step once, broadcasts the plan, runs its own shard;
    the logits come back gathered here. A failure is fatal: the ranks can no longer agree on a step."""

    def __init__(self, runner: ModelRunner, tp: TensorParallel, workers: list[BaseProcess], watchdog: Watchdog) -> None:
        self.runner, self.tp, self.workers = runner, tp, workers
        self.ops = runner.ops  # rank 0's kernels, for the sampler
        # Also when the engine is dropped or the interpreter exits: the next engine may form a group.
        self.shutdown = weakref.finalize(self, _stop_group, tp, workers, watchdog)

    def execute(self, out: SchedulerOutput) -> Logits | None:
        plan = self.runner.plan(out)
        try:
            send_plan(self.tp, plan)
            return self.runner.run(plan)
        except Exception:
            logger.exception("tensor-parallel step failed; the ranks are out of step")
            _exit_fatally(self.workers)


def _stop_group(tp: TensorParallel, workers: list[BaseProcess], watchdog: Watchdog) -> None:
    """``ModelExecutor.shutdown``: stop every worker (they leave their loop and exit), leave the group."""
    watchdog.stop()
    try:
        send_plan(tp, None)
    except Exception:  # a worker already gone: it is killed below
        logger.warning("could not tell every tensor-parallel worker to stop", exc_info=True)
    for worker in workers:
        worker.join(_JOIN_S)
    _kill(workers)
    dist.destroy_process_group()


class Watchdog:
    """Ends the engine process (exit code 1) when a worker dies: a collective with a dead peer could block
    for its whole timeout, and a supervisor restarts a dead process sooner than it finds a stuck one."""

    def __init__(self, workers: list[BaseProcess]) -> None:
        self._workers, self._stopped = workers, threading.Event()
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        multiprocessing.connection.wait([w.sentinel for w in self._workers])
        if not self._stopped.wait(_GRACE_S):
            _exit_fatally(self._workers)


def _exit_fatally(workers: list[BaseProcess]) -> None:
    # A failed collective can beat the peer's exit by a moment: give a dying worker time to be reaped.
    multiprocessing.connection.wait([w.sentinel for w in workers], timeout=_GRACE_S)
    for worker in workers:
        if not worker.is_alive():
            logger.critical("tensor-parallel worker %s (pid %s) exited with code %s", worker.name, worker.pid,
                            worker.exitcode)
    logger.critical("ending the engine process: its tensor-parallel group is broken")
    _kill(workers)
    logging.shutdown()
    os._exit(1)


def _kill(workers: list[BaseProcess]) -> None:
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join(_JOIN_S)


def _check_shardable(config: EngineConfig) -> None:
    """Build the model on the meta device with rank 0's shapes first: a size that does not divide fails here,
    with the layer's message, before any process is spawned."""
    model_config = read_model_config(config.model or ensure_demo_model())
    with torch.device("meta"):
        model_class(model_config.architecture)(model_config, torch.device("meta"), torch.float32,
                                               TensorParallel(0, config.tensor_parallel_size))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
