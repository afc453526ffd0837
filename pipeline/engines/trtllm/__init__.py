"""The GPU targets of the build stage: TensorRT engines (``trtllm-build``) and TensorRT-LLM LLM-API options.

TensorRT-LLM cannot be installed where this project is developed (its wheel comes from NVIDIA's own index and
needs CUDA), so this package is kept thin and checked by contract tests: everything it passes to TensorRT-LLM
is checked against one table of TensorRT-LLM 1.2's option names, allowed values and validity rules (each entry
with the upstream file it was read from), before anything runs. No module here imports ``tensorrt_llm`` at
module level (none imports it at all): the package is found with ``importlib.util.find_spec`` and versions are
read from the installed distributions' metadata.

Modules, each importing only those above it; callers import from them (nothing is re-exported here):

- ``options``: the option tables (trtllm-build, LLM API), their upstream citations and checkers;
- ``rules``: the validity rules, the checkpoint facts they judge, and the build decisions they govern;
- ``preflight``: GPU / environment detection, the checkpoint readers, the checks before any work;
- ``targets``: the ``tensorrt`` and ``pytorch`` build targets.
"""
