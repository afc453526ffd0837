"""tensorrt_llm for the ``cpu`` target: the CPU reference runtime (pipeline.engines.cpu_runtime) in the Python backend.

A reference for correctness and wiring, not TensorRT: it runs the exported quantized checkpoint with its
paged INT8/FP8 KV cache and continuous batching. Same inputs and outputs as the ``tensorrtllm`` backend's
model (see llm_serving.py). Parameters: ``bundle_dir`` (relative to the version folder), ``cpu_threads``
(torch threads; 0: torch's default), ``adaptive_batch_target_ms`` (0: off; else the step latency the
runtime's adaptive batch limit keeps), ``max_running`` (sequences run at once; 0: the build's max_batch_size),
``prefill_chunk_tokens`` (prompt tokens prefilled per scheduler step; 0: whole prompts), ``priority_levels``
and ``default_priority_level`` (request classes: the runtime admits waiting requests by level, 1 first),
``tenants`` (a JSON list of the config's tenants: the runtime's KV pool partitioned, pipeline/tenancy.py).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llm_serving import GenerationModel, Handle  # noqa: E402


class _RuntimeHandle(Handle):
    def __init__(self, request):
        self.request = request

    def stream(self):
        return self.request.stream()

    def cancel(self):
        self.request.cancel()


class TritonPythonModel(GenerationModel):
    def load(self, version_dir, params):
        from pipeline.engines.cpu_runtime import CpuRuntime, SamplingParams
        from pipeline.tenancy import specs_from

        self._sampling = SamplingParams
        threads = int(params.get("cpu_threads", "0") or 0)
        target_ms = float(params.get("adaptive_batch_target_ms", "0") or 0)
        max_running = int(params.get("max_running", "0") or 0)
        chunk = int(params.get("prefill_chunk_tokens", "0") or 0)
        tenants = specs_from(json.loads(params.get("tenants") or "[]"))
        self.runtime = CpuRuntime.load(version_dir / params["bundle_dir"], threads=threads or None,
                                       adaptive_target_ms=target_ms or None, max_running=max_running or None,
                                       prefill_chunk=chunk or None, tenants=tenants)

    def submit(self, job):
        params = self._sampling(max_new_tokens=job.max_new_tokens, temperature=job.temperature, top_k=job.top_k,
                                top_p=job.top_p, seed=job.seed, end_id=job.end_id,
                                stop_token_ids=tuple(w[0] for w in job.stop_words if len(w) == 1))
        return _RuntimeHandle(self.runtime.submit(job.prompt, params, priority=job.priority, tenant=job.tenant or None))

    def stats(self):
        return self.runtime.stats()

    def close(self):
        self.runtime.close()
