# Placeholder until issue #8 (container image releases). It packages the pipeline and the CPU-side
# dependencies so `invoke all` can run in a container; it has not been built here (no Docker engine on
# the development machines). The GPU runtime image on the Triton TensorRT-LLM base comes with issue #8.
FROM python:3.11.11-slim-bookworm
WORKDIR /opt/pipeline
COPY pyproject.toml constraints-cpu.txt tasks.py ./
COPY pipeline ./pipeline
COPY engine_configs ./engine_configs
COPY triton_repo ./triton_repo
COPY scripts ./scripts
# Note: the registry's torch 2.13.0 for x86_64 Linux is a CUDA build (several GB); issue #8 picks the
# image's torch (a CPU build for the cpu target, the TensorRT-LLM base image's own for the GPU targets).
RUN bash scripts/setup-env
ENTRYPOINT [".venv/bin/invoke"]
CMD ["all"]
