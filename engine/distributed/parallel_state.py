"""Who this process is in the tensor-parallel group, and the few collectives the layers and the executor use.

``TensorParallel()`` (size 1) is the single-device engine: every collective is the identity and no process
group exists. With ``size > 1`` the model collectives (all-reduce, gather) run on torch.distributed's default
group (NCCL on CUDA, gloo on CPU); the step plan and the start-up agreement run on a second, gloo, group on CPU
(``control``), whose long timeout lets a worker wait for the next step however long the engine idles."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# A step's collectives finish in milliseconds; this only bounds a rank that is alive but stuck (a dead
# rank is caught within a second by the watchdogs in engine/distributed/executor.py and worker.py).
STEP_TIMEOUT = timedelta(minutes=5)
# Workers block on the control group between steps: an idle engine must not time them out.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(slots=True)
class TensorParallel:
    """This process's place in the group; the layers keep it to size their shards and to reduce."""

    rank: int = 0
    size: int = 1
    control: dist.ProcessGroup | None = None  # gloo, CPU tensors: plans and start-up agreement

    def shard(self, total: int, what: str, parts: int | None = None) -> int:
        """``total`` split in ``parts`` (default: one per rank) equal pieces; a clear error if it does not divide."""
        parts = parts or self.size
        if total % parts:
            raise ValueError(f"tensor_parallel_size={self.size}: {what}={total} is not divisible by {parts}")
        return total // parts

    def kv_heads(self, num_kv_heads: int) -> int:
        """KV heads per rank: a split of them, or one replicated head when there are fewer heads than ranks."""
        if num_kv_heads < self.size:
            if self.size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size={self.size} is neither a divisor nor a multiple of "
                                 f"num_key_value_heads={num_kv_heads}")
            return 1
        return self.shard(num_kv_heads, "num_key_value_heads")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along the last dim, on rank 0 only (None elsewhere)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def agree_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum of ``values`` over all ranks (e.g. KV block counts every rank can hold)."""
        if self.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return t.tolist()

    def device(self, device: str) -> torch.device:
        """This rank's device: ``cuda`` / ``cuda:i`` -> one GPU per rank from there; CPU is shared."""
        d = torch.device(device)
        return torch.device("cuda", (d.index or 0) + self.rank) if d.type == "cuda" and self.size > 1 else d


def set_rank_threads(num_threads: int | None, size: int) -> None:
    """The configured CPU threads per rank, else an equal share of this process's cores: ranks on one
    CPU would otherwise each start a thread per core."""
    torch.set_num_threads(num_threads or max(1, len(os.sched_getaffinity(0)) // size))


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> TensorParallel:
    """Join the group: every rank calls this with the same ``size`` and ``init_method``."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=STEP_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TensorParallel(rank, size, control)
