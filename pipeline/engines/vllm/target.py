"""build stage, vllm target: export the checkpoint for vLLM, load it in vLLM, and check what it computes.

The check runs vLLM's offline engine (the one its server runs) in the serving environment on the export and
compares it with the simulated model, the TensorRT-LLM checkpoint rebuilt in fp32 (what the accuracy gate
measured) and the original model:

- the accuracy gate's figures, through vLLM, on the evaluation tokens: perplexity (against the original's)
  and top-1 agreement with the original model, held to the config's accuracy bounds; the top-1 agreement
  with the simulated model beside them;
- the KV cache vLLM serves: its dtype, and each attention layer's K and V scales as its kernels get them, equal
  to the calibrated ones the export wrote (a StageFailed otherwise: vLLM would run the cache at 1.0);
- greedy tokens for verify's prompts against the simulated model's, each equal or diverging first at a
  near-tie of the reference (``reference.compare``). vLLM computes in bfloat16 on a CPU (its INT8 GEMM takes
  no fp32 activations), and bf16 rounding before a static INT8 activation step moves logits by whole units at
  times, so these are recorded, not gated (measured on SmolLM2: the unquantized bf16 model itself diverges
  from its fp32 run at a margin of 0.40).

The reference models hold one decoder layer at a time (read from disk as a forward reaches it) where their
fp32 weights do not fit this machine's memory bound (``compute.host_memory_bound``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from pipeline import artifacts, console, records
from pipeline.constants import CHECK_PROMPTS as PROMPTS
from pipeline.errors import InputError, StageFailed
from pipeline.summaries import BuildSummary

EXPORT_DIR = artifacts.VLLM_MODEL_DIR
log = logging.getLogger(__name__)

CHECK_FILE = "vllm_check.json"  # inside the export: publish carries it, verify reads its tokens
CHECK_TOKENS = 16
FP8_E4M3_KV = ("fp8", "fp8_e4m3")  # vLLM's KV-cache dtypes the export writes scales for (E4M3: amax / 448)
REFERENCE_HEADROOM_BYTES = 1 << 30  # activations and logits of a 256-token forward, besides the fp32 weights


def reference_figures(ckpt_dir: Path, model_dir: Path, *, prompt_ids: list[list[int]], evaluation: list[list[int]],
                      max_tokens: int, end_id, streamed: bool = False, hf_checkpoint: bool = False) -> dict:
    """(child process) The simulated model's greedy tokens and logits per prompt, and the simulated and the
    original model's top-1 token at each evaluation position. ``streamed``: both models hold one decoder layer
    at a time, read when a forward reaches it (for a model larger than this machine's memory bound).
    ``hf_checkpoint``: ``ckpt_dir`` is the HF unified checkpoint (pipeline.quant.hf_checkpoint reads it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline import families
    from pipeline.engines import reference
    from pipeline.quant.checkpoint import rebuild
    from pipeline.quant.hf_checkpoint import rebuild_hf
    from pipeline.quant.streaming import streamed_original

    def top1(model) -> list[list[int]]:
        with torch.no_grad():
            return [model(torch.tensor([seq])).logits[0, :-1].argmax(-1).tolist() for seq in evaluation]

    sim, _ = rebuild_hf(ckpt_dir) if hf_checkpoint else rebuild(ckpt_dir, model_dir, streamed=streamed)
    greedy = [reference.greedy(sim, p, max_new_tokens=max_tokens, end_id=end_id) for p in prompt_ids]
    out = {"greedy": [(g.tokens, [row.tolist() for row in g.logits]) for g in greedy], "sim_top1": top1(sim)}
    del sim
    hf = AutoConfig.from_pretrained(model_dir)
    original = (streamed_original(model_dir, hf) if streamed else AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=families.attn_implementation(hf.model_type))).eval()
    out["original_top1"] = top1(original)
    return out


def served_kv_problem(written: dict[str, list[float]], served: dict, kv_cache_dtype: str) -> str:
    """What differs between the KV cache asked for and the one vLLM serves (``served``: the worker's
    ``kv_cache``): its dtype, and each attention layer's K and V scales against the ones the export wrote
    (``written``: attention module -> [K, V]); "" where they agree. vLLM serves 1.0 for a scale it did not load."""
    if served["dtype"] != kv_cache_dtype:
        return f"its KV-cache dtype is {served['dtype']}, not {kv_cache_dtype}"
    scales = served["scales"]
    for attention, kv in written.items():
        got = scales.get(f"{attention}.attn")
        if got is None or any(not math.isclose(g, w, rel_tol=1e-6) for g, w in zip(got, kv)):
            return (f"{attention}: the export wrote K and V scales {kv}, and vLLM's attention runs with {got} "
                    f"(1.0: the scale was not loaded)")
    return ""


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def build_vllm(ckpt_dir: Path, model_dir: Path, *, eval_tokens: Path, accuracy_file: Path, cfg, out_dir: Path,
               hf_checkpoint: bool = False) -> BuildSummary:
    """Export, write the engine arguments, check the export in vLLM, write build_settings.json. ``hf_checkpoint``:
    ``ckpt_dir`` is the HF unified checkpoint (a family with no TensorRT-LLM checkpoint here), exported by
    pipeline.engines.vllm.export_hf."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from pipeline import compute
    from pipeline.child import run_in_child
    from pipeline.engines import reference
    from pipeline.engines.build import build_settings, checkpoint_sha256
    from pipeline.engines.vllm import engine_args as ea
    from pipeline.engines.vllm import runtime
    from pipeline.engines.vllm.export import MAX_SHARD_BYTES, export_for_vllm
    from pipeline.engines.vllm.export_hf import export_hf_for_vllm
    from pipeline.fsutil import atomic_write_json

    t0 = time.perf_counter()
    log_path = out_dir / artifacts.STAGE_LOG_FILE
    python = runtime.serving_python()
    version = runtime.vllm_version(python)
    export_dir = out_dir / EXPORT_DIR
    runtime.check_cpu_attention(cfg, model_dir)
    runtime.check_cpu_experts(cfg, ckpt_dir)
    args, env = ea.engine_args(cfg), ea.engine_env(cfg)
    steps = console.Step("build: export for vLLM", total=3)
    exported, _ = run_in_child(export_hf_for_vllm if hf_checkpoint else export_for_vllm, ckpt_dir, model_dir,
                               out_dir=export_dir, dtype=cfg.vllm.dtype, max_shard_bytes=MAX_SHARD_BYTES,
                               kv_scales=args["kv_cache_dtype"] in FP8_E4M3_KV, log_path=log_path,
                               what="the vLLM export")
    atomic_write_json(export_dir / artifacts.VLLM_ENGINE_FILE, {
        "vllm_version": version, "server_module": ea.SERVER_MODULE, "server_flags": ea.server_flags(args),
        "engine_args": args, "env": env})

    steps.advance(what="build: the export checked in vLLM")
    tok = AutoTokenizer.from_pretrained(export_dir)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    evaluation = load_file(str(eval_tokens))[artifacts.TOKENS_KEY].tolist()
    got = runtime.run_worker(python, {"model": str(export_dir), "engine_args": ea.offline_args(args),
                                      "prompts": prompt_ids, "max_tokens": CHECK_TOKENS, "evaluation": evaluation},
                             env, log_path)
    bound = compute.host_memory_bound(cfg.compute)
    fp32_bytes = compute.model_bytes(model_dir, "float32")
    streamed = fp32_bytes + REFERENCE_HEADROOM_BYTES > bound.bytes
    if streamed and hf_checkpoint:
        raise InputError(
            f"the vLLM check's reference, the HF unified checkpoint rebuilt in fp32, is held whole, and "
            f"{fp32_bytes / 2**30:.1f} GiB and its forward's do not fit this machine's "
            f"memory bound {bound}: run the build on a machine with more memory")
    steps.advance(what="build: the simulated model's reference figures")
    ref, _ = run_in_child(reference_figures, ckpt_dir, model_dir, prompt_ids=prompt_ids, evaluation=evaluation,
                          max_tokens=CHECK_TOKENS, end_id=tok.eos_token_id, streamed=streamed,
                          hf_checkpoint=hf_checkpoint, log_path=log_path, bound=bound,
                          what="the simulated model's reference figures")
    steps.stop()
    kv_problem = served_kv_problem(exported.get("kv_cache_scales") or {}, got["kv_cache"], args["kv_cache_dtype"])
    if kv_problem:
        raise StageFailed(f"vLLM does not serve the KV cache the export wrote: {kv_problem}")
    gate = records.read_accuracy(accuracy_file.parent).accuracy
    ppl = math.exp(got["nll_sum"] / max(got["tokens_scored"], 1))
    increase = 100.0 * (ppl / gate.perplexity_original - 1.0)
    top1_original = _agreement(got["top1"], ref["original_top1"])
    tokens = []
    relative = reference.relative_tie_bound(cfg.vllm.dtype)  # vLLM's rounding, not this machine's
    for i, (want, rows) in enumerate(ref["greedy"]):
        verdict = reference.compare(got["tokens"][i], reference.Greedy(want, [torch.tensor(r) for r in rows]),
                                    relative=relative)
        tokens.append({"prompt": PROMPTS[i], **verdict, "vllm": tok.decode(got["tokens"][i]),
                       "simulated": tok.decode(want), "vllm_tokens": got["tokens"][i]})
    bounds = cfg.quantization.accuracy
    check = {
        "vllm_version": version, "max_tokens": CHECK_TOKENS,
        "evaluation_tokens": got["tokens_scored"],
        "perplexity": {"vllm": round(ppl, 4), "simulated": (gate.from_checkpoint or {}).get("perplexity_quantized"),
                       "original": gate.perplexity_original},
        "perplexity_increase_pct": round(increase, 3),
        "top1_agreement_with_original": round(top1_original, 4),
        "top1_agreement_with_simulated": round(_agreement(got["top1"], ref["sim_top1"]), 4),
        "bounds": {"max_perplexity_increase_pct": bounds.max_perplexity_increase_pct,
                   "min_top1_agreement": bounds.min_top1_agreement},
        "greedy_tokens": {"equal": sum(t["equal"] for t in tokens),
                          "near_tie": sum(t["ok"] and not t["equal"] for t in tokens),
                          "diverged": sum(not t["ok"] for t in tokens), "prompts": tokens,
                          "tie_bound": reference.TIE_BOUND, "tie_bound_relative": relative},
        "kv_cache": {"dtype": got["kv_cache"]["dtype"], "scales_served": got["kv_cache"]["scales"]},
        "vllm_load_s": got["load_s"], "vllm_score_s": got["score_s"], "reference_streamed": streamed,
    }
    atomic_write_json(export_dir / CHECK_FILE, check)
    failures = []
    if increase > bounds.max_perplexity_increase_pct:
        failures.append(f"perplexity through vLLM {ppl:.4f} is {increase:.2f} % above the original's "
                        f"{gate.perplexity_original} (bound {bounds.max_perplexity_increase_pct} %)")
    if top1_original < bounds.min_top1_agreement:
        failures.append(f"top-1 agreement with the original {top1_original:.4f} < {bounds.min_top1_agreement}")
    if failures:  # the build's folder is discarded with the failure: the figures go into the message and the log
        log.error("the vLLM check's figures: %s", json.dumps({k: v for k, v in check.items() if k != "greedy_tokens"}))
        raise StageFailed(
            f"the vLLM export does not pass the accuracy gate: {'; '.join(failures)}. In vLLM: perplexity {ppl:.4f} "
            f"(+{increase:.2f} %; the simulated checkpoint's {check['perplexity']['simulated']}), top-1 agreement "
            f"with the original {top1_original:.4f}, with the simulated checkpoint "
            f"{check['top1_agreement_with_simulated']:.4f}. The simulated checkpoint passed the gate, so the export "
            f"or vLLM's arithmetic (bfloat16, its KV-cache dtype) lost it; quantization.accuracy in the config sets "
            f"the bounds, and the stage log has every figure")

    ckpt_hash = checkpoint_sha256(ckpt_dir)
    graphs = {"enabled": not args["enforce_eager"], "batch_sizes": [], "enable_padding": False,
              "cuda_graph_mode": False, "cuda_graph_cache_size": 0}
    provenance = {"runtime": f"vLLM {version} ({cfg.vllm.device})", "vllm": version, "export": exported}
    settings = build_settings(cfg, "vllm", artifact_dir=EXPORT_DIR, kv_algo=args["kv_cache_dtype"], cuda_graphs=graphs,
                              trtllm_version=None, provenance=provenance, ckpt_hash=ckpt_hash,
                              enable_chunked_context=True)
    records.write_build_settings(out_dir, settings)
    return {"target": "vllm", "vllm": version, "checkpoint_sha256": ckpt_hash, "export": exported,
            "kv_cache_dtype": args["kv_cache_dtype"], "check": {k: v for k, v in check.items() if k != "greedy_tokens"},
            "greedy_tokens": {k: v for k, v in check["greedy_tokens"].items() if k != "prompts"},
            "timing_s": round(time.perf_counter() - t0, 1)}


def build_stage(ctx, ckpt_dir: Path, hf_checkpoint: bool = False) -> BuildSummary:
    """The vllm target's build (pipeline.targets.vllm): export ``ckpt_dir`` and check it in vLLM against the
    quantize stage's accuracy figures."""
    return build_vllm(ckpt_dir, ctx.upstream("model") / artifacts.MODEL_DIR,
                      eval_tokens=ctx.upstream("text") / artifacts.EVALUATION_TOKENS_FILE,
                      accuracy_file=ctx.upstream("quantize") / artifacts.ACCURACY_FILE, cfg=ctx.config,
                      out_dir=ctx.out_dir, hf_checkpoint=hf_checkpoint)
