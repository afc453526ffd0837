"""tensorrt_llm for the ``pytorch`` target: TensorRT-LLM's LLM API (PyTorch backend) in the Python backend.

GPU only, inside the Triton TensorRT-LLM image: ``tensorrt_llm`` is imported when the model loads, never
before (it needs a CUDA driver). The LLM is built from the HF unified quantized checkpoint and the build
stage's LLM-API options file (``cuda_graph_config``, ``kv_cache_config``, limits), the same file
``trtllm-serve --extra_llm_api_options`` takes. Same inputs and outputs as the ``tensorrtllm`` backend's
model (see llm_serving.py). Parameters: ``checkpoint_dir``, ``llm_api_options`` (relative to the version
folder).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llm_serving import GenerationModel, Handle  # noqa: E402


class _LlmApiHandle(Handle):
    def __init__(self, result):
        self.result = result

    def stream(self):
        for output in self.result:  # RequestOutput: one item per step with streaming=True
            for token in output.outputs[0].token_ids_diff:
                yield int(token)

    def cancel(self):
        self.result.abort()


class TritonPythonModel(GenerationModel):
    def load(self, version_dir, params):
        import yaml
        from tensorrt_llm import LLM, SamplingParams

        self._sampling = SamplingParams
        options = yaml.safe_load((version_dir / params["llm_api_options"]).read_text()) or {}
        self.llm = LLM(model=str(version_dir / params["checkpoint_dir"]), **options)

    def submit(self, job):
        greedy = job.temperature == 0
        params = self._sampling(
            max_tokens=job.max_new_tokens,
            temperature=None if greedy else job.temperature,
            top_k=1 if greedy else (job.top_k or None),
            top_p=None if greedy else job.top_p,
            seed=job.seed,
            end_id=job.end_id,
            stop_token_ids=[w[0] for w in job.stop_words if len(w) == 1] or None,
        )
        return _LlmApiHandle(self.llm.generate_async(job.prompt, sampling_params=params, streaming=True))

    def close(self):
        self.llm.shutdown()
