"""What quantize needs in memory, checked before it loads anything: the host bound for the whole-model path,
the GPUs' bounds, and whether to stream the model one decoder layer at a time instead
(compute.layer_streaming)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pipeline import families
from pipeline.config import ComputeSection, QuantizationSection
from pipeline.errors import InputError
from pipeline.quant.gate import EVAL_BATCH

log = logging.getLogger(__name__)

# On the CPU this stage holds the model whole, in fp32, several times at once: the original (the accuracy
# gate's reference), the copy ModelOpt quantizes, the model rebuilt from the checkpoint for the read-back
# check, and a copy for the HF export when one is asked for; besides, the libraries, and the gate's logits
# over the vocabulary for a batch of evaluation sequences (both models', and copies). Fitted to SmolLM2's
# default config: 3 x 0.50 GiB + 0.59 GiB + 4 x 256 x 49152 x 4 B x 6 = 3.2 GiB estimated, 3.29 GiB measured
# (scripts/bench_streaming.py). A model that does not fit so is quantized one decoder layer at a time
# (quantize_streams, pipeline.quant.streaming).
IN_MEMORY_COPIES = 3


LIBRARIES_BYTES = 600 * 2**20  # torch, transformers and ModelOpt imported: 555 MB of RSS (CPU wheels)


LOGIT_COPIES = 6


def check_host_memory(model_dir: Path, quant: QuantizationSection, bound, eval_seq_len: int = 0) -> int:
    """Refuse, before any work, a model whose in-memory quantization cannot fit ``bound`` (a compute.Bound);
    returns the bytes it needs (an estimate: see IN_MEMORY_COPIES)."""
    from pipeline import compute as comp

    fp32 = comp.model_bytes(model_dir, "float32")
    copies = IN_MEMORY_COPIES + int(quant.export_hf_checkpoint)
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size") or 0
    logits = EVAL_BATCH * eval_seq_len * vocab * 4 * LOGIT_COPIES
    need = fp32 * copies + LIBRARIES_BYTES + logits
    if need > bound.bytes:
        raise InputError(
            f"quantize in memory on the CPU would hold about {comp.gib(need)}: the model {copies} times in fp32 "
            f"({comp.gib(fp32)} each), the libraries ({comp.gib(LIBRARIES_BYTES)}) and the accuracy gate's "
            f"logits ({comp.gib(logits)}); more than the memory bound {bound.text()}, and "
            f"compute.layer_streaming is never. Set it to auto to quantize one decoder layer at a time, run it on "
            f"a GPU (compute.device: cuda), or on a machine with more memory (compute.max_host_memory).")
    return need


# On GPUs the model is loaded twice in the reference dtype (the accuracy gate's original and the copy ModelOpt
# quantizes), three times where the HF export gets its own copy (families with both exports): the least it can
# hold. The peak is higher: at Llama-3.1-8B's shape on an H200 (scripts/gpu_check.py, no HF export) 55.6 GiB for
# 13.75 GiB of bf16 weights, 4.0 times, for FP8 and INT8 SmoothQuant alike.
GPU_MEASURED_PEAK = 4.0


def check_gpu_memory(model_dir: Path, quant: QuantizationSection, dtype: str, bounds: list) -> int:
    """Refuse, before the model is loaded, GPUs whose bounds (compute.Bound, one per GPU) together cannot hold
    the in-memory path's copies of the model; warn where they are under the measured peak. Returns the least
    bytes it needs."""
    from pipeline import compute as comp

    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    fam = families.FAMILIES.get(model_type)
    copies = 2 + int(bool(quant.export_hf_checkpoint and (fam is None or fam.trtllm_checkpoint)))
    weights = comp.model_bytes(model_dir, dtype)
    need, room = copies * weights, sum(b.bytes for b in bounds)
    held = f"the model {copies} times in {dtype} ({comp.gib(weights)} each)"
    if need > room:
        raise InputError(
            f"quantize in memory on {len(bounds)} GPU(s) holds at least {comp.gib(need)}, {held}; their bound is "
            f"{comp.gib(room)} together ({bounds[0].source}). Give it more GPUs (CUDA_VISIBLE_DEVICES), or set "
            f"compute.layer_streaming: always to quantize one decoder layer at a time"
            + (" (not with quantization.export_hf_checkpoint)" if quant.export_hf_checkpoint else "")
            + (" (not with quantization.accuracy.tasks)" if quant.accuracy.tasks else "") + ".")
    if GPU_MEASURED_PEAK * weights > room:
        log.warning("quantize: the GPUs' bound %s is under the %.1f times the weights (%s) this stage peaked at "
                    "where measured; it may run out of GPU memory", comp.gib(room), GPU_MEASURED_PEAK,
                    comp.gib(int(GPU_MEASURED_PEAK * weights)))
    return need


def gpu_streams(model_dir: Path, quant: QuantizationSection, mode: str, dtype: str, bounds: list) -> bool:
    """On GPUs (in the child, which knows their free memory): whether quantize streams the model layer by layer.
    ``mode`` auto streams where the GPUs' bounds together are under the measured peak (GPU_MEASURED_PEAK times
    the weights) and no HF export (it is not streamed) nor lm-eval task (scored on whole models) is asked for;
    else check_gpu_memory refuses what cannot fit and warns under the peak."""
    from pipeline import compute as comp

    if mode == "auto" and not quant.export_hf_checkpoint and not quant.accuracy.tasks:
        weights, room = comp.model_bytes(model_dir, dtype), sum(b.bytes for b in bounds)
        if GPU_MEASURED_PEAK * weights > room:
            log.info("layer streaming on %d GPU(s): %.1f times the weights (%s) is more than their bound %s (%s)",
                     len(bounds), GPU_MEASURED_PEAK, comp.gib(int(GPU_MEASURED_PEAK * weights)), comp.gib(room),
                     bounds[0].source)
            return True
    check_gpu_memory(model_dir, quant, dtype, bounds)
    return False


def quantize_streams(model_dir: Path, cfg, bound) -> bool:
    """Whether quantize streams the model layer by layer (compute.layer_streaming; auto: on the CPU, when the
    in-memory path would not fit ``bound``; on GPUs the child decides, gpu_streams). Refuses, before any work,
    what neither way can do."""
    from pipeline import compute as comp

    mode = cfg.compute.layer_streaming
    on_cpu = cfg.compute.device == "cpu" or comp.nvidia_gpu_count() == 0
    stream = mode == "always"
    if not stream and on_cpu:
        try:
            check_host_memory(model_dir, cfg.quantization, bound, cfg.text.evaluation.seq_len)
        except InputError:
            if mode == "never":
                raise
            stream = True
    if not stream:
        return False
    if cfg.quantization.accuracy.tasks:
        raise InputError(streamed_tasks_refusal(f"the memory bound {bound.text()}"))
    if cfg.quantization.export_hf_checkpoint:
        raise InputError(
            "quantize: this model is quantized one decoder layer at a time (it does not fit the memory bound "
            f"{bound.text()} whole, or compute.layer_streaming is always), and the HF unified checkpoint "
            "(quantization.export_hf_checkpoint: the pytorch target's, and the only export of "
            f"{', '.join(f.model_type for f in families.FAMILIES.values() if not f.trtllm_checkpoint)}) is not "
            "exported that way yet. Run it on a GPU or a machine with more memory "
            "(compute.max_host_memory), or, for the other families, use the tensorrt or cpu target without it.")
    if on_cpu:
        comp.check_layer_fits(model_dir, "float32", bound, "quantize")
    return True


def streamed_tasks_refusal(bound: str) -> str:
    return (f"quantize: this model does not fit {bound} whole, so it would be quantized one decoder layer at a "
            "time, and quantization.accuracy.tasks scores the whole original and quantized models in memory. Run "
            "it where the model fits twice (compute.max_host_memory, or a GPU), or drop the tasks.")


def gpu_bounds(compute: ComputeSection) -> list:
    """One compute.Bound per visible GPU, for what is still free on it: read again before each load, so that
    the second copy of the model is mapped around the first (compute.max_gpu_memory less what this process holds
    there; else the free memory less the margin)."""
    import torch

    from pipeline import compute as comp

    bounds = []
    for i in range(torch.cuda.device_count()):
        bound = comp.gpu_memory_bound(compute, torch.cuda.mem_get_info(i)[0])
        if compute.max_gpu_memory is not None:
            bound = comp.Bound(max(0, bound.bytes - torch.cuda.memory_allocated(i)), bound.source)
        bounds.append(bound)
    return bounds
