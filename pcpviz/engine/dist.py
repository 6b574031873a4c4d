"""The PCP process group: an all-gather along dim 0 (KV, hidden states) and, for the MoE model,
a reduce-scatter along dim 0 (its experts' partial sums, ``pcpviz.engine.moe``).

``ProcessGroupPCP`` wraps ``torch.distributed`` (gloo on CPU, NCCL on CUDA,
``env://`` rendezvous so torchrun works across hosts); ``SingleRank`` is PCP=1.
Every collective is counted, so a trace can show how many a step issued and a
test can assert that dummy runs issue none.
"""

from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as tdist

from pcpviz.trace.collectives import describe

__all__ = ["PCPGroup", "SingleRank", "ProcessGroupPCP", "init_process_group"]


class PCPGroup:
    rank: int = 0
    world_size: int = 1
    num_collectives: int = 0
    timer = None  # a pcpviz.engine.phase_timer.PhaseTimer: all-gathers are timed as "gather"
    ledger: list[str] | None = None  # the step's collectives, in order (``trace.collectives.describe``)

    def start_step(self) -> list[str]:
        """A recorded step begins: the ledger (kept from now on, emptied)."""
        if self.ledger is None:
            self.ledger = []
        self.ledger.clear()
        return self.ledger

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # [M, ...] -> [N*M, ...]
        raise NotImplementedError

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:  # [N*M, ...] -> [M, ...]: the sum, rank's rows
        raise NotImplementedError

    def broadcast_json(self, doc, src: int = 0):
        """Plain JSON data from rank ``src`` (a single rank keeps its own)."""
        return doc


class SingleRank(PCPGroup):
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.num_collectives += 1
        return x

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        self.num_collectives += 1
        return x


class ProcessGroupPCP(PCPGroup):
    def __init__(self) -> None:
        self.rank = tdist.get_rank()
        self.world_size = tdist.get_world_size()
        # The step's plan travels on a CPU (gloo) group, as vLLM's engine core sends it over
        # shared memory: on NCCL a broadcast of host data would copy to the device and back
        # and synchronise the stream every step.
        self._control = None
        if tdist.get_backend() == "nccl":
            try:
                self._control = tdist.new_group(backend="gloo")
            except Exception:  # noqa: BLE001 - no gloo here: the plan goes over NCCL as before
                self._control = None

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.timer:
            with self.timer.phase("gather"):
                return self._all_gather(x)
        return self._all_gather(x)

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.num_collectives += 1
        if self.ledger is not None:  # kept once a recorded step began (``start_step``)
            self.ledger.append(describe("all_gather", "pcp", x))
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

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """vLLM's ``reduce_scatter(x, dim=0)`` (``moe_runner.py:853-861``): the element-wise sum over
        the ranks of ``x`` [N*M, ...], of which this rank keeps rows ``[rank*M, (rank+1)*M)``. On
        gloo, which has no reduce-scatter, an all-reduce then the rank's slice (the same result)."""
        if self.timer:
            with self.timer.phase("gather"):
                return self._reduce_scatter(x)
        return self._reduce_scatter(x)

    def _reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        self.num_collectives += 1
        if self.ledger is not None:
            self.ledger.append(describe("reduce_scatter", "pcp", x))
        m = x.shape[0] // self.world_size
        if x.shape[0] != m * self.world_size:
            raise ValueError(f"reduce_scatter of {x.shape[0]} rows over {self.world_size} ranks")
        if tdist.get_backend() == "nccl":
            out = torch.empty((m,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            tdist.reduce_scatter_tensor(out, x.contiguous())
            return out
        wide = x.float().contiguous()  # gloo: float32 (sums of bf16 rows in float32, then rounded)
        tdist.all_reduce(wide)
        return wide[self.rank * m:(self.rank + 1) * m].to(x.dtype)

    def broadcast_json(self, doc, src: int = 0):
        """``doc`` (plain JSON data) from rank ``src`` on every rank, as UTF-8 JSON text in uint8
        tensors, so nothing is unpickled (``broadcast_object_list`` would run pickle on what the
        network delivered). One collective when the text fits ``FRAME`` bytes (a decode step's
        plan does): the frame holds an 8-byte length and the text's head; a longer text (a new
        long prompt) sends its tail in a second collective."""
        group = self._control
        dev = torch.device("cuda", torch.cuda.current_device()) \
            if group is None and tdist.get_backend() == "nccl" else torch.device("cpu")
        frame = torch.zeros(FRAME, dtype=torch.uint8)
        if self.rank == src:
            data = json.dumps(doc, separators=(",", ":")).encode("utf-8")
            head = data[: FRAME - 8]
            frame[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
            if head:
                frame[8: 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        frame = frame.to(dev)
        tdist.broadcast(frame, src=src, group=group)
        host = frame.cpu().numpy().tobytes()
        size = int.from_bytes(host[:8], "little")
        rest = size - (FRAME - 8)
        if rest > 0:
            tail = torch.frombuffer(bytearray(data[FRAME - 8:]), dtype=torch.uint8).to(dev) if self.rank == src \
                else torch.empty(rest, dtype=torch.uint8, device=dev)
            tdist.broadcast(tail, src=src, group=group)
        if self.rank == src:
            return doc
        text = host[8: 8 + min(size, FRAME - 8)] + (bytes(tail.cpu().numpy()) if rest > 0 else b"")
        return json.loads(text.decode("utf-8"))


FRAME = 4096  # bytes of the plan's first broadcast: an 8-byte length and the JSON text's head


def init_process_group(device: str, timeout_s: float, store_file: str | None = None) -> PCPGroup:
    """Join the group described by the env:// variables (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT). World size 1 needs no rendezvous.

    ``store_file``: rendezvous through this file instead (``pcpviz.run`` on one host): no
    TCP store listens anywhere, and gloo's own sockets stay on the loopback interface."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return SingleRank()
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs: dict = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    if store_file is not None:
        kwargs.update(store=tdist.FileStore(store_file, world), rank=int(os.environ["RANK"]), world_size=world)
    else:
        kwargs["init_method"] = "env://"
    tdist.init_process_group(backend=backend, **kwargs)
    return ProcessGroupPCP()
