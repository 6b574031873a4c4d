"""A finished rank never aborts at exit: 50 launches of 2 ranks through the ranks' own
rendezvous, collectives and exit path, every rank exit 0.

The abort was ``terminate called without an active exception`` (SIGABRT, exit -6) after all
work was done: a gloo/store ``std::thread`` still joinable when interpreter teardown ran the C++
destructors. Ranks now rendezvous through a FileStore (no TCP store thread) and leave with
``rank_main._exit_now`` (no teardown) once their results are written. To keep 50 launches
cheap, the ranks are forked from this test's process (torch imported once) instead of
started as ``python -m pcpviz.engine.rank_main``; everything after the fork is the ranks' code.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

LAUNCHES = 50


def _rank(rank: int, world: int, store: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    import torch

    from pcpviz.engine.dist import init_process_group
    from pcpviz.engine.rank_main import _exit_now, _shutdown_process_group

    code = 1
    try:
        torch.set_num_threads(1)
        group = init_process_group("cpu", 30.0, store)
        doc = group.broadcast_json({"step": 3, "rows": [{"req_id": "req0", "slot": 0}]} if rank == 0 else None)
        gathered = group.all_gather(torch.full((2,), rank, dtype=torch.int64))
        assert doc["rows"][0]["req_id"] == "req0" and gathered.tolist() == [0, 0, 1, 1]
        _shutdown_process_group()
        with open(f"{out}.{rank}", "w") as f:
            f.write("done")
        code = 0
    finally:
        _exit_now(code)


@pytest.mark.slow
def test_fifty_launches_exit_cleanly(tmp_path):
    import torch  # noqa: F401 - imported once, inherited by the forked ranks

    ctx = mp.get_context("fork")
    bad = []
    for i in range(LAUNCHES):
        store, out = str(tmp_path / f"store{i}"), str(tmp_path / f"done{i}")
        procs = [ctx.Process(target=_rank, args=(r, 2, store, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        codes = [p.exitcode for p in procs]
        if codes != [0, 0] or not all(os.path.exists(f"{out}.{r}") for r in range(2)):
            bad.append((i, codes))
        for p in procs:
            if p.is_alive():
                p.kill()
    assert not bad, f"launches with a rank not exiting 0 (-6 = the abort): {bad}"


def _plan_sizes(rank: int, store: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    import json

    from pcpviz.engine.dist import FRAME, init_process_group
    from pcpviz.engine.rank_main import _exit_now, _shutdown_process_group

    code = 1
    try:
        group = init_process_group("cpu", 30.0, store)
        docs = []
        for n in (0, 3, FRAME - 8 - 1, FRAME - 8, FRAME - 8 + 1, 200_000):
            # a JSON string whose text is n bytes ('"' + n - 2 characters + '"'); 0: a plan
            docs.append("x" * (n - 2) if n else {"rows": [{"req_id": "réq"}], "step": 0})
        ok = []
        for d in docs:
            got = group.broadcast_json(d if rank == 0 else None)
            ok.append(got == d)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(ok, f)
        _shutdown_process_group()
        code = 0
    finally:
        _exit_now(code)


def test_plan_broadcast_of_any_size_arrives_whole(tmp_path):
    """The plan goes in one frame when it fits and in a frame and a tail when not: texts just
    below, at and one byte above what the frame holds, and 200 kB."""
    import json

    ctx = mp.get_context("fork")
    store, out = str(tmp_path / "store"), str(tmp_path / "ok")
    procs = [ctx.Process(target=_plan_sizes, args=(r, store, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert json.load(open(f"{out}.1")) == [True] * 6
