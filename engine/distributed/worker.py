"""A tensor-parallel rank other than 0: its own process (spawned), its slice of the model and of every KV block;
it runs each plan rank 0 broadcasts and never samples."""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from functools import partial

import torch.distributed as dist

import cuda_ext
from engine.config import EngineConfig
from engine.distributed.parallel_state import TensorParallel, init_tensor_parallel, set_rank_threads
from engine.distributed.plan import receive_plan
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.resolved_config import resolve_config

logger = logging.getLogger(__name__)


def run_worker(rank: int, config: EngineConfig, init_method: str) -> None:
    """The process's target: join the group, load this rank's shard, run plans until rank 0 says stop."""
    _exit_with_parent()
    size = config.tensor_parallel_size
    set_rank_threads(config.num_threads, size)
    tp = init_tensor_parallel(rank, size, init_method, TensorParallel(rank, size).device(config.device))
    ops = cuda_ext.load_ops(config.attention_backend, config.attention_kernel)
    load = partial(load_model, ops=ops, quantization=config.quantization,
                   quantization_group_size=config.quantization_group_size, show_progress=False, tp=tp)
    resolved, model = resolve_config(config, load, tp)
    runner = ModelRunner(model, resolved, ops)
    while (plan := receive_plan(tp)) is not None:
        runner.run(plan)
    dist.destroy_process_group()


def _exit_with_parent() -> None:
    """Rank 0 gone (killed, crashed) means nobody will ever send a plan: exit instead of waiting forever."""
    parent = multiprocessing.parent_process()

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        logger.error("tensor-parallel rank 0 exited; this worker (pid %d) exits too", os.getpid())
        os._exit(1)

    if parent is not None:
        threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
