"""Hugging Face LLM -> mixed-precision quantized TensorRT-LLM deployment on Triton Inference Server.

All logic lives in this package; ``tasks.py`` only wires invoke tasks to it. Nothing here imports
torch, transformers or TensorRT-LLM at module level, so configs can be checked on any machine.
"""

__version__ = "0.1.0"
