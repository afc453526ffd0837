"""Bench's CPU accounting on a real process tree shaped like a Triton server's: a root, a model's Python-backend
stub (its command line as Triton starts it) and a process the model started under it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pipeline.serving.bench.cpu import SERVER, cpu_by_role, per_token

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}:\n    pass\n"


def test_each_process_is_charged_to_the_nearest_stub_above_it_and_per_token_splits_engine_from_frontend(tmp_path):
    model = tmp_path / "repo" / "m_tensorrt_llm" / "1" / "model.py"
    model.parent.mkdir(parents=True)
    done = tmp_path / "done"
    # the model burns 0.4 s itself and starts a child that burns 0.4 s (vLLM's engine core under its stub)
    model.write_text(
        "import subprocess, sys, pathlib\n" + BURN.format(s=0.4) +
        f"subprocess.run([{sys.executable!r}, '-c', {BURN.format(s=0.4)!r}])\n"  # its argv[0] is the stub's name
        f"pathlib.Path({str(done)!r}).write_text('x')\n" + "import time\ntime.sleep(60)\n")
    root_code = (BURN.format(s=0.2) +
                 "import subprocess, sys, time\n"
                 f"subprocess.Popen(['bash', '-c', 'exec -a triton_python_backend_stub {sys.executable} {model}'])\n"
                 "time.sleep(60)\n")
    root = subprocess.Popen([sys.executable, "-c", root_code], start_new_session=True)
    try:
        before = {}
        deadline = time.monotonic() + 60
        while not done.exists():
            assert time.monotonic() < deadline, "the tree did not finish burning"
            time.sleep(0.05)
        after = cpu_by_role(root.pid)
        assert set(after) == {SERVER, "m_tensorrt_llm"}
        assert after["m_tensorrt_llm"] >= 0.75  # the stub's own 0.4 s and its child's, reaped by the stub
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()
    assert after[SERVER] >= 0.19
    split = per_token(before, after, 100, "m_tensorrt_llm")
    assert split["engine_ms"] == pytest.approx(after["m_tensorrt_llm"] * 10)
    assert split["frontend_ms"] == pytest.approx(after[SERVER] * 10)
    assert split["total_ms"] == pytest.approx((after["m_tensorrt_llm"] + after[SERVER]) * 10)
    assert per_token(before, after, 100, None) == {"total_ms": split["total_ms"], "engine_ms": None,
                                                  "frontend_ms": None}
