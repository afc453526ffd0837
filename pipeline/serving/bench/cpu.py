"""CPU time of a serving process tree, per role, and per generated token: what the frontend costs beside the engine.

A Triton server's tree: ``tritonserver`` itself, then one Python backend stub per model (its command line is
``triton_python_backend_stub <repository>/<model>/<version>/model.py ...``), each with whatever its model starts
(vLLM's engine core process under the vLLM model's stub). Each process's user + system time is charged to the
nearest stub above it (its model), else to ``tritonserver``; the engine's share is the LLM model's (``<name>_
tensorrt_llm``), the frontend's everything else: the server, the ensemble's pre- and postprocessing, the
streaming and unary models. vLLM's own OpenAI server is one tree with no stubs: all of it is ``server``, and
the split is not made.

A process that ended is counted in its parent's reaped-children time once the parent has waited for it (the
kernel's accounting); one not yet reaped at a reading is missed by that reading.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

STUB = "triton_python_backend_stub"
SERVER = "server"  # the root process (tritonserver, or vLLM's OpenAI server)


def cpu_by_role(pid: int) -> dict[str, float]:
    """User + system CPU seconds of ``pid`` and its descendants, by role: ``server``, or a model's name."""
    import psutil  # the only consumer; read at measuring time

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    seen: dict[int, tuple[list[str], int, float]] = {}
    for proc in procs:
        try:
            t = proc.cpu_times()
            # children_*: the children it has reaped (a process that ended between two readings counts there)
            seen[proc.pid] = (proc.cmdline(), proc.ppid(), t.user + t.system + t.children_user + t.children_system)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue

    def role(p: int) -> str:
        if p == pid or p not in seen:
            return SERVER
        cmd, ppid, _ = seen[p]
        if len(cmd) > 1 and Path(cmd[0]).name == STUB:
            return Path(cmd[1]).parent.parent.name  # <repository>/<model>/<version>/model.py
        return role(ppid)

    out: dict[str, float] = {}
    for p, (_, _, seconds) in seen.items():
        out[role(p)] = out.get(role(p), 0.0) + seconds
    return out


def per_token(before: dict[str, float], after: dict[str, float], tokens: int,
              engine_model: Optional[str]) -> dict[str, Optional[float]]:
    """CPU milliseconds per generated token between two readings: the whole tree's, and where ``engine_model``
    is one of its roles, the engine's and the frontend's (the rest)."""
    used = {k: max(0.0, v - before.get(k, 0.0)) for k, v in after.items()}
    total = sum(used.values())
    engine = used.get(engine_model) if engine_model else None
    per = 1000.0 / tokens if tokens > 0 else 0.0
    return {"total_ms": total * per, "engine_ms": None if engine is None else engine * per,
            "frontend_ms": None if engine is None else (total - engine) * per}
