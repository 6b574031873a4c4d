"""The rank processes of a ``pcpviz.run``: each one's environment, its stderr drained, and,
when the run fails, which rank caused it (``blame``).

A rank whose peer died or hung fails too, with a connection or timeout error of its own, so
the first failure seen is often not the cause: PCP=2, rank 1 hits a full disk and exits; rank
0 then fails its all-gather with "Connection closed by peer"; ``blame`` names rank 1 and its
disk error.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading

from pcpviz.engine.run_config import RunConfig

__all__ = ["RankError", "RankProcess", "blame", "rank_env", "die_with_parent", "clean_stale_work_dirs",
           "WORK_PREFIX"]


class RankError(RuntimeError):
    """A rank failed; ``.rank`` names it."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank


WORK_PREFIX = "pcpviz-run-"
"""The prefix of a run's work directory in the temporary directory: ``pcpviz-run-<launcher pid>-``."""
_PEER_ERRORS = re.compile(r"connection closed by peer|connection reset|broken pipe|timed out|timeout|"
                          r"socket|recvbytes|sendbytes|remote process exited|peer", re.IGNORECASE)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_work_dirs() -> None:
    """Remove the work directories of earlier runs whose launcher is gone (killed by SIGKILL
    before its ``finally``): ``pcpviz-run-<pid>-*`` of this user with no live ``<pid>``."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        m = re.match(rf"^{WORK_PREFIX}(\d+)-", name)
        path = os.path.join(root, name)
        if not m or _alive(int(m.group(1))):
            continue
        try:
            if os.lstat(path).st_uid == os.getuid() and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Ranks get SIGKILL when the launcher dies, so none outlives a killed launcher."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: ranks still stop on their collective timeout
        pass


def rank_env(cfg: RunConfig, rank: int, port: int) -> dict:
    """The rank's environment: env:// variables, this pcpviz first on the path (absolute, so
    the rank imports the launcher's package whatever its working directory holds)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above pcpviz/
    paths = [root] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(cfg.pcp), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(cfg.pcp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)), PCPVIZ_PROGRESS="pipe")
    # one host: gloo's sockets (the CPU group; on CUDA the plan's control group) on loopback only
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _proc_state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (``T`` stopped, ``Z`` zombie, ...), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class RankProcess:
    """One rank process and the tail of its stderr (drained so a chatty rank never blocks)."""

    def __init__(self, rank: int, proc: subprocess.Popen) -> None:
        self.rank, self.proc = rank, proc
        self.tail: collections.deque[str] = collections.deque(maxlen=64)
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.tail.append(line.rstrip("\n"))

    def error(self, work: str) -> str:
        """The rank's own one-line account of its failure."""
        self.thread.join(timeout=2)
        for line in reversed(self.tail):
            if line.startswith("PCPVIZ_ERROR "):
                return line[len("PCPVIZ_ERROR "):]
        try:
            with open(os.path.join(work, f"error_rank{self.rank}.txt")) as f:
                first = f.readline().strip()
            if first:
                return first
        except OSError:
            pass
        code = self.proc.returncode
        how = f"killed by {_signal_name(code)}" if code is not None and code < 0 else f"exited with code {code}"
        last = next((line for line in reversed(self.tail) if line.strip()), "")
        return f"process {how}" + (f": {last.strip()}" if last else "")


def blame(ranks: list[RankProcess], work: str) -> RankError:
    """The rank that caused a failure, with its real cause.

    A rank whose peer died or hung fails too, later or at the same moment, with a connection or
    timeout error; so: a failed rank with an error of its own first (a full disk, a bad step),
    then a rank that died without a word (a signal, ``os._exit``), then a rank still running
    while the others failed waiting for it (stopped or hung), then the first failure."""
    failed = [r for r in ranks if r.proc.returncode not in (None, 0)]
    errors = {r.rank: r.error(work) for r in failed}
    own = [r for r in failed if not _PEER_ERRORS.search(errors[r.rank])
           and not errors[r.rank].startswith("process ")]
    if own:
        return RankError(own[0].rank, errors[own[0].rank])
    silent = [r for r in failed if errors[r.rank].startswith("process ")]
    if silent:
        return RankError(silent[0].rank, errors[silent[0].rank])
    running = [r for r in ranks if r.proc.returncode is None]
    if running:
        r = running[0]
        state = "is stopped (SIGSTOP?)" if _proc_state(r.proc.pid) == "T" else "stopped responding"
        peers = ", ".join(str(f.rank) for f in failed)
        return RankError(r.rank, f"{state}; rank {peers} gave up waiting for it "
                                 f"({errors[failed[0].rank]})")
    return RankError(failed[0].rank, errors[failed[0].rank])
