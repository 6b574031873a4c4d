"""The PCP process group: the only collective PCP needs is an all-gather along dim 0.

``ProcessGroupPCP`` wraps ``torch.distributed`` (gloo on CPU, NCCL on CUDA,
``env://`` rendezvous so torchrun works across hosts); ``SingleRank`` is PCP=1.
Every collective is counted, so a trace can show how many a step issued and a
test can assert that dummy runs issue none.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as tdist

__all__ = ["PCPGroup", "SingleRank", "ProcessGroupPCP", "init_process_group"]


class PCPGroup:
    rank: int = 0
    world_size: int = 1
    num_collectives: int = 0

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # [M, ...] -> [N*M, ...]
        raise NotImplementedError

    def broadcast_object(self, obj, src: int = 0):
        return obj


class SingleRank(PCPGroup):
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.num_collectives += 1
        return x


class ProcessGroupPCP(PCPGroup):
    def __init__(self) -> None:
        self.rank = tdist.get_rank()
        self.world_size = tdist.get_world_size()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.num_collectives += 1
        x = x.contiguous()
        out = torch.empty((self.world_size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype,
                          device=x.device)
        if x.dtype == torch.bfloat16 and x.device.type == "cpu":
            # gloo gathers neither bf16 nor int16: ship float32 (exact for bf16 values).
            wide = torch.empty(out.shape, dtype=torch.float32)
            tdist.all_gather_into_tensor(wide, x.float())
            out.copy_(wide)
        else:
            tdist.all_gather_into_tensor(out, x)
        return out

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        tdist.broadcast_object_list(box, src=src)
        return box[0]


def init_process_group(device: str, timeout_s: float) -> PCPGroup:
    """Join the group described by the env:// variables (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT). World size 1 needs no rendezvous."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return SingleRank()
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs = {}
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    tdist.init_process_group(backend=backend, init_method="env://",
                             timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return ProcessGroupPCP()
