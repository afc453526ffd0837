"""The edge target's engine: NVIDIA TensorRT Edge-LLM 0.11.0 (pipeline.targets.edge).

- ``env``: its export environment (``.venv-edgellm``, Python 3.11: the wheel is cp311 only, and its export extra
  pins torch, transformers, onnx and numpy that the pipeline's own pins do not allow);
- ``worker``: runs in that environment and reads the export back (ONNX checker, inputs and outputs, weights);
- ``device``: the device-side commands and manifest the bundle carries;
- ``target``: the build, preflight and publish entry points.

Facts and their sources: tests/data/upstream/edgellm.json.
"""
