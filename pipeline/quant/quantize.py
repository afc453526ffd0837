"""quantize stage: the plan -> a ModelOpt-quantized model -> a TensorRT-LLM checkpoint, behind an accuracy gate.

Runs in a child process (pipeline.child) with its log beside the checkpoint. In order:
1. the rules users trip on are checked before any work (AWQ group size must divide every INT4 layer's
   input width, and its per-rank width for row-parallel layers under tensor parallelism; tensor parallelism
   must divide the attention and KV heads; layers fused into one GEMM share one format: q/k/v, and
   gate/up for the HF unified checkpoint); formats that need a GPU (NVFP4, MX) are refused by the config;
2. the ModelOpt config is built from the plan: the base format's preset, then one entry per layer whose
   format differs (later entries win, as in ModelOpt), the plan's high-precision layers disabled,
   INT8/FP8 KV-cache quantizers;
3. calibration on the calibration tokens (``mtq.quantize``). A plan that mixes formats is calibrated with
   ``max`` first, then each calibration algorithm on its own layers with every other quantizer paused
   (SmoothQuant for the int8_sq layers, AWQ-lite for the INT4 ones), as each format would be alone;
4. the accuracy gate on the evaluation tokens (disjoint from calibration): perplexity of the original and of
   the quantized (simulated) model, teacher-forced top-1 agreement and mean KL(original || quantized), the
   score of each lm-eval task configured on both (pipeline.quant.tasks; not with layer streaming), plus
   a few greedy generations side by side for a person to read (not gated: near-ties flip argmaxes);
5. a deep copy of the calibrated model when the config asks for the HF unified checkpoint (ModelOpt's HF
   export modifies the model in place, so it never sees a model already exported);
6. the TensorRT-LLM checkpoint export (one rank file per tensor-parallel rank), and a check of what it wrote:
   quant_algo (MIXED_PRECISION with a quant_cfg.json listing exactly the plan's quantized layers and their
   formats, when formats are mixed), kv_cache_quant_algo, exclusions = the plan's high-precision layers,
   rope fields, weight dtypes. A tied lm_head that ModelOpt wrote as a second copy of the embedding is
   dropped (pipeline.quant.tied_head), so the checkpoint holds what the plan counts;
7. the HF unified checkpoint (``hf_checkpoint/``) from the copy, checked: hf_quant_config.json names the
   format, the KV-cache format and the plan's kept layers, and its config.json parses under transformers;
8. the checkpoint read back by pipeline.quant.checkpoint, and the same accuracy figures for that rebuilt model
   (without KV-cache quantization, which the CPU runtime adds);
9. the HF unified checkpoint read back too (pipeline.quant.hf_checkpoint) and held to the gate itself: its
   fused groups are resmoothed and requantized by the export, so it is not the model step 4 measured.

Steps 3-8 hold the model whole. A model that does not fit the memory bound so goes through the same steps
one decoder layer at a time (``quantize_streams`` decides; pipeline.quant.streaming does it, and
``run_stage`` reads its checkpoint back in a second child process), with a bit-equal checkpoint.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Optional, Union

from pipeline import artifacts, console, families, records
from pipeline.config import BuildSection, ComputeSection, QuantizationSection
from pipeline.errors import StageFailed
from pipeline.quant.export_checks import check_export, check_hf_export, check_rules
from pipeline.quant.gate import (
    EVAL_BATCH,
    accuracy_figures,
    check_gate,
    gate_failures,
    generations_markdown,
    greedy_generations,
    input_device,
)
from pipeline.quant.memory import gpu_bounds, gpu_streams
from pipeline.quant.recipe import calibrate_phase, calibration_phases, modelopt_config
from pipeline.quant.tied_head import embedding_bytes, share_tied_embedding
from pipeline.summaries import QuantizeFigures

log = logging.getLogger(__name__)


def load_model(model_dir: Path, device: str, dtype_name: str, compute: ComputeSection):
    """The HF model for calibration: on the CPU as it is; on CUDA spread over the visible GPUs by a device map
    (accelerate), each GPU held to what its bound leaves (gpu_bounds)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype_name)
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    attention = families.attn_implementation(model_type)
    if device == "cpu":
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention).eval()
    max_memory = {i: b.bytes for i, b in enumerate(gpu_bounds(compute))}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention,
                                                device_map="auto", max_memory=max_memory).eval()


def run_quantize(model_dir: Path, calibration_file: Path, *, evaluation_file: Path, plan_file: Path, table_file: Path,
                 quant: QuantizationSection, build: BuildSection, out_dir: Path,
                 compute: Optional[ComputeSection] = None, stream: bool = False,
                 memory_bound=None) -> Union[QuantizeFigures, dict]:
    """The stage's work, in a child process; returns the summary for the manifest (streamed: what
    finish_streamed needs to read the checkpoint back in a second child, marked read_back_pending).

    ``stream``: calibrate, gate, export and read back one decoder layer at a time (pipeline.quant.streaming).
    ``memory_bound``: the compute.Bound the parent set (recorded; default: computed here)."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    from pipeline import compute as comp

    compute = compute or ComputeSection()
    bound = memory_bound or comp.host_memory_bound(compute)
    device = comp.resolve_device(compute)
    ref_dtype = comp.reference_dtype(device, "float32")
    log.info("quantize on %s in %s", device, ref_dtype)

    t0 = time.perf_counter()
    table = json.loads(table_file.read_text())
    table_layers = {l["name"]: l for l in table["layers"]}
    plan = records.read_plan(plan_file, list(table_layers))
    model_config = json.loads((model_dir / "config.json").read_text())
    baseline = quant.weight_format == "none"  # the unquantized baseline: exported as it is, nothing to gate
    check_rules(plan, quant, build, model_config, table_layers)

    calib = torch.as_tensor(load_file(str(calibration_file))[artifacts.TOKENS_KEY])
    evals = torch.as_tensor(load_file(str(evaluation_file))[artifacts.TOKENS_KEY])
    ckpt = out_dir / artifacts.TRTLLM_CHECKPOINT_DIR
    kept = set(plan.kept_high_precision())
    if device == "cuda" and not stream:
        stream = gpu_streams(model_dir, quant, compute.layer_streaming, ref_dtype, gpu_bounds(compute))
    if stream:
        from pipeline.quant import streaming

        log.info("layer streaming: one decoder layer at a time")
        res = streaming.quantize_streamed(model_dir, calib, evals=evals, plan=plan, quant=quant, build=build,
                                          model_config=model_config, ckpt=ckpt, scratch=out_dir / "layer_exports",
                                          device=device, dtype_name=ref_dtype, table_layers=table_layers,
                                          baseline=baseline)
        shared = share_tied_embedding(ckpt, model_config)
        streamed_export = {**check_export(ckpt, plan, quant, model_config, build.tensor_parallel_size),
                           **_embedding_facts(ckpt, shared)}
        from safetensors.torch import save_file

        save_file({"hidden": res["reference_final_hidden"].cpu().contiguous()}, str(out_dir / READ_BACK_REFERENCE))
        return {"read_back_pending": True, "accuracy": res["accuracy"], "exported": streamed_export,
                "calibrate_s": res["calibrate_s"], "elapsed_s": time.perf_counter() - t0, "device": device,
                "calibration_tokens": int(calib.numel()), "greedy_generations": quant.greedy_generations,
                "compute": comp.compute_record(device, ref_dtype, bound)}
    steps = console.Step("quantize: calibrate", total=4)  # the stage's steps; a bar of their own under it
    original = load_model(model_dir, device, ref_dtype, compute)
    # the model ModelOpt quantizes in place; on GPUs a second load (a deep copy of a dispatched model would
    # share accelerate's hooks)
    model = copy.deepcopy(original) if device == "cpu" else load_model(model_dir, device, ref_dtype, compute)
    calib = calib.to(input_device(model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    import modelopt.torch.quantization as mtq

    cfg = None if baseline else modelopt_config(plan, quant)

    passes = 0

    def forward_loop(m):
        nonlocal passes
        passes += 1  # each calibration algorithm runs its own passes over the batches
        for b in console.track(range(0, calib.shape[0], EVAL_BATCH), f"quantize: calibration pass {passes}, batches"):
            m(calib[b:b + EVAL_BATCH])

    if not baseline:
        with torch.no_grad():
            mtq.quantize(model, cfg, forward_loop)
            for algorithm, layers in calibration_phases(plan, quant):
                log.info("calibrating %d layer(s) with %s", len(layers), algorithm)
                calibrate_phase(model, algorithm, layers, forward_loop)
    t_quant = time.perf_counter() - t0
    log.info("calibrated in %.1f s", t_quant)
    steps.advance(what="quantize: accuracy gate")

    accuracy = accuracy_figures(original, model, evals)
    t_tasks = None if baseline else _score_tasks(accuracy, original=original, quantized=model, tokenizer=tokenizer,
                                                      quant=quant, steps=steps)
    generations = greedy_generations(original, model, tokenizer) if quant.greedy_generations else []
    log.info("accuracy: %s", accuracy)
    if not baseline:
        check_gate(accuracy, quant, plan, table_layers)

    steps.advance(what="quantize: export")
    from modelopt.torch.export import (
        export_hf_checkpoint,
        export_tensorrt_llm_checkpoint,
    )

    fam = families.FAMILIES[model_config["model_type"]]
    # ModelOpt's HF export modifies the model in place (resmoothing, requantizing): it gets its own copy,
    # taken before the TensorRT-LLM export touches the model (none where the family has no such export)
    hf_source = None
    if quant.export_hf_checkpoint:
        hf_source = copy.deepcopy(model) if fam.trtllm_checkpoint else model
    dtype = torch.bfloat16 if build.dtype == "bfloat16" else torch.float16
    exported: Optional[dict] = None
    if fam.trtllm_checkpoint:
        with torch.no_grad():
            export_tensorrt_llm_checkpoint(model, fam.decoder_type, dtype, export_dir=ckpt,
                                           inference_tensor_parallel=build.tensor_parallel_size)
        shared = share_tied_embedding(ckpt, model_config)
        exported = {**check_export(ckpt, plan, quant, model_config, build.tensor_parallel_size),
                    **_embedding_facts(ckpt, shared)}
    hf_exported = None
    if hf_source is not None:
        hf_dir = out_dir / artifacts.HF_CHECKPOINT_DIR
        if build.dtype != "float32":  # ModelOpt writes unquantized weights in the model's own dtype
            hf_source = hf_source.to(dtype)
        with torch.no_grad():
            export_hf_checkpoint(hf_source, dtype, export_dir=hf_dir)
        del hf_source
        for name in artifacts.TOKENIZER_FILES:  # the LLM API serves the folder on its own
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, hf_dir / name)
        hf_exported = check_hf_export(hf_dir, plan, quant, model_config, build.target)
    steps.advance(what="quantize: read back")
    from_ckpt = read_facts = None
    if exported is not None:
        # the model as the checkpoint says, read back by our own reader: the figure closest to the engine's
        from pipeline.quant.checkpoint import rebuild

        rebuilt, read_facts = rebuild(ckpt, model_dir, kept)
        if device == "cuda":  # fp32, as read; on the GPU the evaluation pass takes seconds, not hours
            rebuilt = rebuilt.to(input_device(original))
        from_ckpt = accuracy_figures(original, rebuilt, evals)
        del rebuilt
    if hf_exported is not None:
        hf_exported["read_back"], hf_exported["accuracy"] = read_back_hf(out_dir / artifacts.HF_CHECKPOINT_DIR,
                                                                           original, evals, kept, quant)
    if exported is None:  # the HF unified checkpoint is the only one: its read-back is the checkpoint's figure
        assert hf_exported is not None  # check_rules refuses such a family without export_hf_checkpoint
        exported, read_facts, from_ckpt = hf_exported, hf_exported.pop("read_back"), hf_exported.pop("accuracy")
        hf_exported = None
    # whichever checkpoint was exported was read back just above
    assert from_ckpt is not None and read_facts is not None
    steps.stop()
    return _finish(out_dir, accuracy, from_ckpt=from_ckpt, read_facts=read_facts, exported=exported,
                   hf_exported=hf_exported, generations=generations, plan=plan,
                   calibration_tokens=int(calib.numel()), evaluation_tokens=int(evals.numel()),
                   compute_record=comp.compute_record(device, ref_dtype, bound), t_quant=t_quant, t0=t0,
                   t_tasks=t_tasks)


def _score_tasks(accuracy: dict, *, original, quantized, tokenizer, quant: QuantizationSection,
                 steps: console.Step) -> Optional[float]:
    """The lm-eval tasks' rows added to the gate's figures (quantization.accuracy.tasks); the seconds they took,
    None without tasks."""
    if not quant.accuracy.tasks:
        return None
    from pipeline.quant.tasks import task_figures

    t0 = time.perf_counter()
    steps.advance(0, what="quantize: accuracy gate, lm-eval tasks")
    accuracy["tasks"] = task_figures(original, quantized, tokenizer, quant.accuracy.tasks)
    seconds = time.perf_counter() - t0
    log.info("lm-eval tasks in %.1f s: %s", seconds, accuracy["tasks"])
    return seconds


def _embedding_facts(ckpt: Path, shared: dict) -> dict:
    """What the checkpoint holds besides the plan's linears: the embedding, and whether it is lm_head too."""
    return {"embedding_bytes": embedding_bytes(ckpt), "lm_head_shares_embedding": shared["lm_head_shares_embedding"],
            "lm_head_sharing": shared["why"]}


def read_back_hf(hf_dir: Path, original, evals, kept: set[str], quant: QuantizationSection) -> tuple[dict, dict]:
    """The HF unified checkpoint (what the pytorch target serves) read back by pipeline.quant.hf_checkpoint and
    held to the accuracy gate: ModelOpt's HF export gives each of q/k/v and gate/up one pre-quant scale and one
    input scale and requantizes their weights, so it computes something other than the model the gate measured
    (on a tiny Llama with INT4 AWQ the change was 70 % of quantization's own: tests/quant/test_hf_checkpoint.py).
    Returns (reader facts, the gate's figures); a StageFailed when they fail the gate."""
    from pipeline.quant.hf_checkpoint import rebuild_hf

    model, facts = rebuild_hf(hf_dir, kept)
    model = model.to(input_device(original))
    acc = accuracy_figures(original, model, evals)
    log.info("HF unified checkpoint read back: %s", acc)
    failed = gate_failures(acc, quant)
    if failed:
        raise StageFailed(
            f"the HF unified checkpoint (quantization.export_hf_checkpoint, what the pytorch target serves), read "
            f"back, fails the accuracy gate: {'; '.join(failed)} (perplexity {acc['perplexity_original']} -> "
            f"{acc['perplexity_quantized']}), although the calibrated model passed it. ModelOpt's HF export gives "
            f"q/k/v and gate/up one pre-quant scale and one input scale per group; keep such a group in high "
            f"precision with plan rules, or serve the TensorRT-LLM checkpoint (build.target tensorrt) where the "
            f"model's family has one.")
    return facts, {k: acc[k] for k in ("perplexity_quantized", "perplexity_increase_pct", "top1_agreement",
                                       "kl_divergence")}


READ_BACK_REFERENCE = "read_back_reference.safetensors"  # the streamed pass's original final hidden states


def finish_streamed(model_dir: Path, evaluation_file: Path, *, plan_file: Path, table_file: Path, out_dir: Path,
                    partial: dict) -> QuantizeFigures:
    """The read-back of a streamed quantize, in a second child process (a fresh interpreter: the streamed
    pass's heap and libraries do not add to its peak); returns the stage's summary."""
    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import load_file as load_torch

    from pipeline import compute as comp
    from pipeline.quant import streaming

    t0 = time.perf_counter() - partial["elapsed_s"]
    comp.return_freed_memory_to_the_os()
    table_layers = {l["name"]: l for l in json.loads(table_file.read_text())["layers"]}
    plan = records.read_plan(plan_file, list(table_layers))
    kept = set(plan.kept_high_precision())
    evals = torch.as_tensor(load_file(str(evaluation_file))[artifacts.TOKENS_KEY])
    reference = out_dir / READ_BACK_REFERENCE
    hidden = load_torch(str(reference))["hidden"].to(partial["device"])
    reference.unlink()
    ckpt = out_dir / artifacts.TRTLLM_CHECKPOINT_DIR
    from_ckpt, read_facts = streaming.read_back_streamed(ckpt, model_dir, kept=kept, evals=evals,
                                                         reference_final_hidden=hidden, device=partial["device"])
    evaluation_tokens = int(evals.numel())
    del hidden, evals
    comp.trim_heap()
    generations = _streamed_generations(model_dir, ckpt, kept) if partial["greedy_generations"] else []
    return _finish(out_dir, partial["accuracy"], from_ckpt=from_ckpt, read_facts=read_facts,
                   exported=partial["exported"], hf_exported=None, generations=generations, plan=plan,
                   calibration_tokens=partial["calibration_tokens"], evaluation_tokens=evaluation_tokens,
                   compute_record=partial["compute"], t_quant=partial["calibrate_s"], t0=t0, streamed=True)


def _streamed_generations(model_dir: Path, ckpt: Path, kept: set[str]) -> list[dict]:
    """The greedy generations of a streamed quantize: the original model and the written checkpoint, both
    with their decoder layers streamed (one layer in memory at a time; every token reads both models again:
    GREEDY_PROMPTS x GREEDY_NEW_TOKENS forwards each)."""
    from transformers import AutoTokenizer

    from pipeline.quant import streaming
    from pipeline.quant.checkpoint import rebuild

    quantized, _ = rebuild(ckpt, model_dir, kept, streamed=True)
    original = streaming.streamed_original(model_dir, quantized.config)
    rows = greedy_generations(original, quantized, AutoTokenizer.from_pretrained(model_dir))
    log.info("greedy generations, both models streamed (peak RSS %s)", streaming._peak())
    return rows


def run_stage(model_dir: Path, calibration_file: Path, *, evaluation_file: Path, plan_file: Path, table_file: Path,
              quant: QuantizationSection, build: BuildSection, out_dir: Path, compute: ComputeSection, stream: bool,
              bound, log_path: Path) -> tuple[QuantizeFigures, int]:
    """The stage in child processes: (summary, peak RSS of the largest). A streamed quantize reads its
    checkpoint back in a second child."""
    from pipeline.child import run_in_child

    summary, peak = run_in_child(run_quantize, model_dir, calibration_file, evaluation_file=evaluation_file,
                                 plan_file=plan_file, table_file=table_file, quant=quant, build=build, out_dir=out_dir,
                                 compute=compute, stream=stream, memory_bound=bound, log_path=log_path,
                                 what="quantize", bound=bound)
    if summary.get("read_back_pending"):
        summary, second = run_in_child(finish_streamed, model_dir, evaluation_file, plan_file=plan_file,
                                       table_file=table_file, out_dir=out_dir, partial=summary, log_path=log_path,
                                       what="quantize (read-back)", bound=bound)
        peak = max(peak, second)
    return summary, peak


def _finish(out_dir: Path, accuracy: dict, *, from_ckpt: dict, read_facts: dict, exported: dict, hf_exported,
            generations: list[dict], plan: records.Plan, calibration_tokens: int, evaluation_tokens: int,
            compute_record: dict, t_quant: float, t0: float,
            streamed: bool = False, t_tasks: Optional[float] = None) -> QuantizeFigures:
    """The accuracy files, and the stage's summary."""
    ckpt = out_dir / artifacts.TRTLLM_CHECKPOINT_DIR
    if not ckpt.is_dir():  # a family exported as the HF unified checkpoint only
        ckpt = out_dir / artifacts.HF_CHECKPOINT_DIR
    accuracy["from_checkpoint"] = {k: from_ckpt[k] for k in ("perplexity_quantized", "perplexity_increase_pct",
                                                             "top1_agreement", "kl_divergence")}
    accuracy["from_checkpoint"]["kv_cache_quantized"] = False  # the CPU runtime (build stage) adds it
    if hf_exported and hf_exported.get("accuracy"):
        accuracy["from_hf_checkpoint"] = {**hf_exported["accuracy"], "kv_cache_quantized": False}
    records.write_accuracy(out_dir, records.Accuracy.model_validate({"accuracy": accuracy, "generations": generations}))
    (out_dir / artifacts.GENERATIONS_FILE).write_text(generations_markdown(generations, accuracy, streamed))
    return {"accuracy": accuracy, "checkpoint": {**exported, "read_back": read_facts},
            "checkpoint_bytes": sum(p.stat().st_size for p in ckpt.iterdir()),
            "hf_checkpoint": hf_exported, "layer_streaming": streamed,
            "kept_high_precision": len(plan.kept_high_precision()),
            "calibration_tokens": calibration_tokens, "evaluation_tokens": evaluation_tokens,
            "compute": compute_record,
            "timing_s": {"calibrate": round(t_quant, 1), "total": round(time.perf_counter() - t0, 1),
                         **({} if t_tasks is None else {"lm_eval_tasks": round(t_tasks, 1)})}}


