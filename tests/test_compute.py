"""The compute section: the memory bound a real memory cgroup sets, the checks a stage makes against it before
any work, and `device: cuda` refused on a machine without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DEFAULT_CONFIG, REPO, memory_cgroup, needs_memory_cgroup

from pipeline import compute
from pipeline.child import run_in_child
from pipeline.config import ComputeSection
from pipeline.errors import ConfigError, EnvironmentProblem, InputError

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start


def _limit_in(cgroup: str) -> tuple[int, str]:  # runs in a child that joins the cgroup first
    Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    return compute.host_memory_limit()


def _bound_in(cgroup: str, ballast_mib: int) -> tuple[int, str, int]:  # a child that joins, then holds ballast
    Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    ballast = bytearray(ballast_mib * 2**20)  # noqa: F841 - held (and touched: bytearray zero-fills) meanwhile
    limit, source = compute.host_memory_limit()
    bound = compute.host_memory_bound(ComputeSection(memory_margin=0.0))
    return limit, source, bound.bytes


@needs_memory_cgroup
def test_the_default_bound_is_the_memory_cgroups_limit_less_what_its_processes_hold(tmp_path):
    """A stage's parent computes its child's bound while it stays in the same cgroup: what the cgroup's
    processes hold already (here: 100 MiB of ballast and the interpreter) is not the child's to use."""
    with memory_cgroup(300 * 2**20) as cg:
        (limit, source), _ = run_in_child(_limit_in, str(cg), log_path=tmp_path / "child.log")
        (_, _, bound), _ = run_in_child(_bound_in, str(cg), 100, log_path=tmp_path / "child2.log")
    assert limit == 300 * 2**20 and str(cg) in source
    assert bound <= 200 * 2**20  # 300 MiB less at least the 100 MiB ballast
    assert bound > 100 * 2**20  # an interpreter with the pipeline's light imports holds far less than 100 MiB
    bound = compute.host_memory_bound(ComputeSection(memory_margin=0.25))
    assert bound.bytes < compute.host_memory_limit()[0]  # this process, outside the test cgroup


def test_configured_bounds_win_and_sizes_come_from_the_headers(tiny_model_dir):
    assert compute.host_memory_bound(ComputeSection(max_host_memory="2.5GiB")).bytes == int(2.5 * 2**30)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    layer = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * i + 2 * h  # + 2 norms
    assert compute.decoder_layer_bytes(tiny_model_dir, "float32") == 4 * layer
    assert compute.model_bytes(tiny_model_dir, "bfloat16") * 2 == compute.model_bytes(tiny_model_dir, "float32")


def test_a_bound_below_one_decoder_layer_is_refused_naming_both(tiny_model_dir):
    layer = compute.decoder_layer_bytes(tiny_model_dir, "float32")
    small = compute.Bound(layer - 1, "compute.max_host_memory")
    with pytest.raises(ConfigError, match=r"sensitivity: one decoder layer of this model is .* GiB in float32, "
                                          r"more than the memory bound .* \(compute.max_host_memory\)"):
        compute.check_layer_fits(tiny_model_dir, "float32", small, "sensitivity")
    assert compute.check_layer_fits(tiny_model_dir, "float32", compute.Bound(layer, "x"), "sensitivity") == layer


def test_quantize_refuses_a_model_that_cannot_fit_in_memory_before_starting(tiny_model_dir):
    from pipeline.config import QuantizationSection
    from pipeline.quant.gate import EVAL_BATCH
    from pipeline.quant.memory import IN_MEMORY_COPIES, LIBRARIES_BYTES, LOGIT_COPIES, check_host_memory

    fp32 = compute.model_bytes(tiny_model_dir, "float32")
    logits = EVAL_BATCH * 64 * 512 * 4 * LOGIT_COPIES  # 64 evaluation tokens per sequence, a 512-token vocabulary
    need = check_host_memory(tiny_model_dir, QuantizationSection(), compute.Bound(2**40, "x"), 64)
    assert need == IN_MEMORY_COPIES * fp32 + LIBRARIES_BYTES + logits
    with pytest.raises(InputError, match="the model 4 times in fp32"):
        check_host_memory(tiny_model_dir, QuantizationSection(export_hf_checkpoint=True, kv_cache="fp8"),
                          compute.Bound(4 * fp32 + LIBRARIES_BYTES + logits - 1, "x"), 64)


def test_quantize_on_gpus_refuses_bounds_under_its_copies_of_the_model_and_warns_under_the_measured_peak(
        tiny_model_dir, caplog):
    """Two bf16 copies on GPUs (the gate's original and the quantized one), three with the HF export's own; the
    GPUs' bounds are summed (accelerate spreads each copy over them)."""
    from pipeline.config import QuantizationSection
    from pipeline.quant.memory import GPU_MEASURED_PEAK, check_gpu_memory

    bf16 = compute.model_bytes(tiny_model_dir, "bfloat16")
    assert bf16 == compute.model_bytes(tiny_model_dir, "float32") // 2
    gpus = lambda total: [compute.Bound(total // 2, "free GPU memory less compute.memory_margin 0.1")] * 2  # noqa: E731
    roomy = int(GPU_MEASURED_PEAK * bf16) + 2
    with caplog.at_level("WARNING"):
        assert check_gpu_memory(tiny_model_dir, QuantizationSection(), "bfloat16", gpus(roomy)) == 2 * bf16
    assert "may run out of GPU memory" not in caplog.text
    with pytest.raises(InputError, match=r"on 2 GPU\(s\) holds at least .* the model 2 times in bfloat16 .* "
                                         r"\(free GPU memory less compute.memory_margin 0.1\)"
                                         r".*layer_streaming: always"):
        check_gpu_memory(tiny_model_dir, QuantizationSection(), "bfloat16", gpus(2 * bf16 - 2))
    hf = QuantizationSection(export_hf_checkpoint=True, kv_cache="fp8")
    with pytest.raises(InputError, match="the model 3 times in bfloat16.*not with quantization.export_hf_checkpoint"):
        check_gpu_memory(tiny_model_dir, hf, "bfloat16", gpus(3 * bf16 - 2))
    with caplog.at_level("WARNING"):
        assert check_gpu_memory(tiny_model_dir, hf, "bfloat16", gpus(3 * bf16)) == 3 * bf16
    assert "under the 4.0 times the weights" in caplog.text and "may run out of GPU memory" in caplog.text


def test_quantize_on_gpus_streams_under_the_measured_peak_unless_told_not_to_or_exporting_hf(tiny_model_dir):
    """layer_streaming auto streams where the GPUs' bounds are under the measured peak; never (and an HF export,
    which is not streamed, or lm-eval tasks) keeps the model whole: refused under its copies, allowed (with a
    warning) above."""
    from pipeline.config import QuantizationSection
    from pipeline.quant.memory import GPU_MEASURED_PEAK, gpu_streams

    bf16 = compute.model_bytes(tiny_model_dir, "bfloat16")
    plain, hf = QuantizationSection(), QuantizationSection(export_hf_checkpoint=True, kv_cache="fp8")
    one = lambda n: [compute.Bound(n, "compute.max_gpu_memory")]  # noqa: E731
    peak = int(GPU_MEASURED_PEAK * bf16)
    assert gpu_streams(tiny_model_dir, plain, "auto", "bfloat16", one(peak)) is False
    assert gpu_streams(tiny_model_dir, plain, "auto", "bfloat16", one(peak - 1)) is True
    assert gpu_streams(tiny_model_dir, plain, "auto", "bfloat16", one(bf16)) is True  # where whole would not fit
    assert gpu_streams(tiny_model_dir, plain, "never", "bfloat16", one(peak - 1)) is False
    with pytest.raises(InputError, match="the model 2 times"):
        gpu_streams(tiny_model_dir, plain, "never", "bfloat16", one(2 * bf16 - 1))
    assert gpu_streams(tiny_model_dir, hf, "auto", "bfloat16", one(3 * bf16)) is False
    with pytest.raises(InputError, match="the model 3 times.*not with quantization.export_hf_checkpoint"):
        gpu_streams(tiny_model_dir, hf, "auto", "bfloat16", one(3 * bf16 - 1))
    # lm-eval tasks score the whole models: never streamed either
    tasks = QuantizationSection(accuracy={"tasks": [{"name": "t", "path": str(tiny_model_dir)}]})
    assert gpu_streams(tiny_model_dir, tasks, "auto", "bfloat16", one(2 * bf16)) is False
    with pytest.raises(InputError, match="the model 2 times.*not with quantization.accuracy.tasks"):
        gpu_streams(tiny_model_dir, tasks, "auto", "bfloat16", one(2 * bf16 - 1))


def test_gpus_are_counted_from_the_drivers_proc_entries_else_its_device_nodes(tmp_path, monkeypatch):
    """A container sees the driver's /proc/driver/nvidia/gpus; a sandboxed kernel (gVisor) may pass only the
    device nodes /dev/nvidia0, ... beside nvidiactl and nvidia-uvm, which are not GPUs."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "null"):
        (dev / name).touch()
    monkeypatch.setattr(compute, "NVIDIA_GPUS_DIR", tmp_path / "no-proc")
    monkeypatch.setattr(compute, "NVIDIA_DEV_DIR", dev)
    assert compute.nvidia_gpu_count() == 2
    proc = tmp_path / "proc"
    (proc / "0000:3b:00.0").mkdir(parents=True)
    monkeypatch.setattr(compute, "NVIDIA_GPUS_DIR", proc)
    assert compute.nvidia_gpu_count() == 1  # the driver's own list first
    monkeypatch.setattr(compute, "NVIDIA_GPUS_DIR", tmp_path / "no-proc")
    monkeypatch.setattr(compute, "NVIDIA_DEV_DIR", tmp_path / "no-dev")
    assert compute.nvidia_gpu_count() == 0


@pytest.mark.skipif(compute.nvidia_gpu_count() > 0, reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_stops_before_any_work(tmp_path):
    with pytest.raises(EnvironmentProblem, match="compute.device is cuda, but this machine has no NVIDIA GPU"):
        compute.check_device(ComputeSection(device="cuda"))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "invoke", "sensitivity", "--config", str(DEFAULT_CONFIG),
                           "--work-root", str(tmp_path),
                           "--set", "compute.device=cuda"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "compute.device is cuda" in proc.stdout + proc.stderr
    assert not (tmp_path / "smollm2-135m-cpu" / "model").exists()  # nothing downloaded
    assert time.monotonic() - t0 < 60  # the interpreter and invoke start; the check itself is a directory read


@pytest.mark.heavy
def test_the_gpu_check_flow_passes_on_a_cpu_with_a_tiny_model(tmp_path):
    """scripts/gpu_check.py as it runs on a GPU, on the CPU with a 2-layer model (about 2 minutes on 2 cores)."""
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--tiny", "--work",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS: sensitivity and quantize (fp8, int8_sq) of a tiny Llama on cpu" in proc.stdout
    summaries = json.loads((tmp_path / "summary.json").read_text())  # each checkpoint is dropped once read
    assert sorted(summaries) == ["fp8/quantize", "fp8/sensitivity", "int8_sq/quantize", "int8_sq/sensitivity"]
    assert {s["compute"]["device"] for s in summaries.values()} == {"cpu"}
    assert (tmp_path / "int8_sq-quantize.log").read_text()
