"""The ``vllm`` build target: the plan exported as a checkpoint vLLM loads, and vLLM's engine arguments.

- ``export``: the quantize stage's TensorRT-LLM checkpoint (what the accuracy gate measured) rewritten as an
  HF folder in compressed-tensors format, SmoothQuant folded into the layers before each linear;
- ``engine_args``: vLLM's engine arguments derived from the config, and the server's argv;
- ``runtime``: where the serving environment's Python is (vLLM lives in its own virtual environment, as
  serving lives in its own container: its torch, transformers and huggingface_hub pins are not the build
  environment's);
- ``worker.py``: the script that runs *inside* that environment (vLLM and the standard library only): loads
  an export and writes greedy tokens and prompt log-probabilities as JSON.

vLLM is never imported in this environment: every use of it is a child process of the serving Python.
"""
