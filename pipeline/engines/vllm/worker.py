"""Runs inside the vLLM serving environment (vLLM and the standard library only; no pipeline imports).

    python worker.py REQUEST.json RESULT.json

REQUEST: {"model": dir, "engine_args": {EngineArgs field: value}, "prompts": [[token ids]], "max_tokens": n,
"evaluation": [[token ids]]}. It loads the model with vLLM's offline ``LLM`` (the engine its server runs),
generates greedy tokens for each prompt (all at once: vLLM batches them) and, for each evaluation sequence,
the log-probability vLLM gives each of its tokens and its own top-1 token there (``prompt_logprobs=1``: the
actual token and the most likely one), then writes RESULT: {"tokens": [[ids]], "nll_sum": float,
"tokens_scored": int, "top1": [[id per scored position]], "load_s", "generate_s", "score_s", "vllm": version,
"kv_cache": {"dtype": the KV-cache dtype vLLM serves, "scales": {attention layer: [K scale, V scale]}}}: the
scales each attention layer's kernels are handed (``_k_scale_float`` / ``_v_scale_float``, what vLLM 0.32's
CPU and CUDA attention read), asked of the model in its worker (``LLM.apply_model`` with worker_probes.py's function).
"""

import json
import os
import sys
import time


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        req = json.load(f)
    t0 = time.perf_counter()
    # LLM.apply_model sends served_kv_scales to the engine's worker process by pickling it, which vLLM allows
    # only with this set; the engine here is this check's own, on a local model
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from worker_probes import served_kv_scales  # beside this script (see that module)

    llm = LLM(model=req["model"], **req["engine_args"])
    t_load = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], greedy, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    t_gen = time.perf_counter() - t0 - t_load
    nll, scored, top1 = 0.0, 0, []
    if req.get("evaluation"):
        score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["evaluation"]], score, use_tqdm=False)
        for seq, out in zip(req["evaluation"], outs):
            best = []
            for tok, lp in zip(seq[1:], out.prompt_logprobs[1:]):  # the first token has no prediction
                nll -= lp[tok].logprob
                best.append(min(lp, key=lambda t: lp[t].rank))
                scored += 1
            top1.append(best)
    scales = {}
    for worker in llm.apply_model(served_kv_scales):  # one per rank: every rank's layers hold the same scales
        scales.update(worker)
    kv = {"dtype": llm.llm_engine.vllm_config.cache_config.cache_dtype, "scales": scales}
    result = {"kv_cache": kv, "tokens": tokens, "nll_sum": nll, "tokens_scored": scored, "top1": top1,
              "load_s": round(t_load, 1),
              "generate_s": round(t_gen, 1), "score_s": round(time.perf_counter() - t0 - t_load - t_gen, 1),
              "vllm": vllm.__version__}
    with open(result_path, "w") as f:
        json.dump(result, f)
    llm.llm_engine.engine_core.shutdown()  # the engine core process stops (and frees its shared memory) now
    # Done: leave without the interpreter's teardown. vLLM 0.32's CPU build sometimes aborts in it after its
    # engine core has shut down ("terminate called without an active exception", exit -6: seen in one of two
    # builds of SmolLM2 on a 2-core AVX-512 machine), which would fail a check whose results are written. The
    # engine core and workers are in this process's group, which the caller ends (runtime.run_worker).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
