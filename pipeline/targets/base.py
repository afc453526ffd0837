"""What a build target is to the stages: the interface every target implements, and the registry they ask.

A build target (``build.target``) is one way to serve a quantized checkpoint: a TensorRT engine, TensorRT-LLM's
LLM API, this project's CPU reference runtime, vLLM. The stages never compare the target's name: they ask the
target for what differs (which checkpoint it reads, which serving settings its runtime has, which server and
frontends serve it, which Dockerfile stage ships it, ...). A new target is a module under ``pipeline/targets/``
with a subclass of :class:`Target`, plus one line in ``pipeline/targets/__init__.py``'s registry.

This module sits below the config (``pipeline.config`` asks a target to check its own rules), so it imports
nothing above it. What a target does at build time lives in its engine package and is named here by a dotted
path (``module:function``), imported only when that stage runs: listing targets imports no torch, vLLM or
TensorRT-LLM.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Sequence

from pipeline.errors import InputError

if TYPE_CHECKING:  # the config imports this module; only its types are needed here
    from pipeline.config import PipelineConfig
    from pipeline.records import BuildSettings

# The triton section's keys that set how a runtime batches and schedules: each target says which its runtime reads
# (Target.serving_settings); a config that sets another is refused (pipeline.config.schema._check_serving_keys).
# The servers a target is served by (Target.server), each started by pipeline.serving.serve.server_for_target:
SERVER_TRITON = "triton"  # nvidia-pytriton's Triton server, its Python models in the pipeline's environment
SERVER_TRITON_VLLM = "triton-vllm"  # the same server, its Python models in vLLM's serving environment
SERVER_VLLM_OPENAI = "vllm-openai"  # vLLM's own OpenAI server
SERVER_IMAGE_TRITON = "image-triton"  # the Triton TensorRT-LLM image's tritonserver, one per GPU rank where needed
SERVING_SETTINGS = ("adaptive_batch", "max_running", "prefill_chunk_tokens", "priority_levels", "scheduler_policy",
                    "kv_cache_free_gpu_memory_fraction", "tenants")
# What a target needs of this machine to build and serve it (Target.requirements), each one check of `invoke
# doctor` (pipeline.doctor, which says how to get what is missing):
NEEDS_TRITON = "triton-server"  # nvidia-pytriton's tritonserver (SERVER_TRITON, SERVER_TRITON_VLLM)
NEEDS_IMAGE_TRITON = "image-tritonserver"  # the Triton TensorRT-LLM image's tritonserver (SERVER_IMAGE_TRITON)
NEEDS_VLLM_ENV = "vllm-env"  # vLLM's serving environment (.venv-vllm, or VLLM_PYTHON)
NEEDS_VLLM_CPU = "cpu-features"  # a CPU vLLM's CPU build runs on: AVX-512 or AMX
NEEDS_GPU = "gpu"  # an NVIDIA GPU (of build.target_sm where a TensorRT-LLM build names one)
NEEDS_TRTLLM = "tensorrt-llm"  # TensorRT-LLM build.trtllm_version, importable
NEEDS_TRTLLM_BUILD = "trtllm-build"  # its trtllm-build command
NEEDS_EDGELLM_ENV = "edgellm-env"  # TensorRT Edge-LLM's export environment (.venv-edgellm, or EDGELLM_PYTHON)
SERVER_NEEDS = {SERVER_TRITON: (NEEDS_TRITON,), SERVER_TRITON_VLLM: (NEEDS_TRITON, NEEDS_VLLM_ENV),
                SERVER_VLLM_OPENAI: (NEEDS_VLLM_ENV,), SERVER_IMAGE_TRITON: (NEEDS_IMAGE_TRITON, NEEDS_GPU)}


class Target:
    """One build target. Subclasses set the class attributes and override the methods whose answer depends on
    the config; the base answers for a target served by one Triton server with no TensorRT-LLM."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line: what is built and what serves it
    engine_label: ClassVar[str] = "Triton"  # what serves it, in the image's title
    artifact_dir: ClassVar[str]  # the build stage's folder for it (a name from pipeline.artifacts)
    # files the build leaves in artifact_dir; publish refuses a folder without them
    artifact_files: ClassVar[tuple[str, ...]] = ()
    # where the tokenizer files are inside artifact_dir (None: publish takes them from the model folder)
    tokenizer_subdir: ClassVar[Optional[str]] = None
    # the triton_repo/ folder holding the Python model that runs it (None: a C++ backend, tensorrtllm); a
    # llm_serving.GenerationModel, which takes text and streams it itself, so publish makes the streaming model an
    # ensemble of it alone (no decoupled BLS call)
    model_code: ClassVar[Optional[str]] = None
    # the Triton backend of the engine model ("python" or "tensorrtllm")
    triton_backend: ClassVar[str] = "python"
    # the build's entry point, "module:function" (function(ctx: StageContext, checkpoint, hf_checkpoint) -> dict)
    build_entry: ClassVar[str]
    # publish's own entry point where the build is not a Triton model repository, "module:function"
    # (function(ctx: StageContext) -> dict); None: the Triton repository (pipeline.serving.publish)
    publish_entry: ClassVar[Optional[str]] = None
    # built here, run on another device only (the edge target's Jetson): `invoke all` ends at publish, and verify
    # and bench are the published bundle's device check
    device_only: ClassVar[bool] = False
    # the build stage's preflight, "module:function" (function(loaded) -> None): stop before any work when this
    # machine cannot build it; None: nothing to check
    preflight_entry: ClassVar[Optional[str]] = None
    # verify's own entry point where its frontends need their own checks, "module:function" (function(repo, prov,
    # out_dir, prompts, max_tokens, concurrent, frontends) -> dict); None: verify's Triton checks
    verify_entry: ClassVar[Optional[str]] = None
    # the target runs this project's reference runtime on this CPU: verify computes the reference tokens itself and
    # checks the served ones against them (elsewhere answers are checked for agreement only), and the report and
    # summary say so (its speed says nothing of a GPU's); report_note: what the build section of the report prints
    reference_runtime: ClassVar[bool] = False
    report_note: ClassVar[str] = ""
    # needs NVIDIA GPUs and TensorRT-LLM: built and served only in the Triton TensorRT-LLM image
    gpu_only: ClassVar[bool] = False
    # builds a TensorRT engine per rank (trtllm-build): one tritonserver per GPU rank, an engine tied to its release
    engine_per_rank: ClassVar[bool] = False
    # serves the HF unified checkpoint (quantization.export_hf_checkpoint) rather than the TensorRT-LLM one
    serves_hf_checkpoint: ClassVar[bool] = False
    # the KV-cache formats (quantization.kv_cache) the runtime takes
    kv_formats: ClassVar[tuple[str, ...]] = ("int8", "fp8", "none")
    # the triton keys of SERVING_SETTINGS its runtime reads
    serving_settings: ClassVar[frozenset[str]] = frozenset()
    # runs on one process: tensor and pipeline parallel sizes must be 1
    single_process: ClassVar[bool] = False
    # the runtime exports the pipeline's own latency family (trtllm_pipeline_model_metrics)
    pipeline_metrics: ClassVar[bool] = True
    # `invoke tune` measures its serving settings (on a GPU target: a plan of points where no tritonserver runs)
    tunable: ClassVar[bool] = True
    untuned_why: ClassVar[str] = ""  # where not tunable: what sets its serving settings instead
    # gate and up of a dense MLP are one GEMM in what it serves (the plan gives them one format)
    fuses_gate_up: ClassVar[bool] = False
    # serves every family whose layers its export holds (families.ALL_TARGETS); False: only the families that name
    # it in pipeline/families.py, families_note saying why
    every_family: ClassVar[bool] = True
    families_note: ClassVar[str] = ""
    # records the TensorRT-LLM release it was built for (provenance build.trtllm_version)
    records_trtllm_version: ClassVar[bool] = False

    # ---------------------------------------------------------------- answers that depend on the config

    def check(self, cfg: "PipelineConfig") -> list[str]:
        """The target's own rules on a config: one message per problem (field, value, what would work)."""
        return []

    # the frontends a build can be served by (vllm.frontends chooses among them), the default first
    default_frontends: ClassVar[tuple[str, ...]] = ("triton",)

    def frontends(self, cfg: "PipelineConfig") -> tuple[str, ...]:
        """What serves a build in verify and bench, first the one `invoke serve` and the image run."""
        return self.default_frontends

    def server(self, frontend: Optional[str] = None) -> str:
        """Which server (SERVER_*) serves a build through ``frontend`` (None: the default one); an InputError
        naming the target's frontends for another."""
        if frontend not in (None, *self.default_frontends):
            raise InputError(f"the {self.name} target is served by one of {', '.join(self.default_frontends)}, "
                             f"not {frontend!r}")
        return SERVER_IMAGE_TRITON if self.gpu_only else SERVER_TRITON

    def on_cpu(self, cfg: "PipelineConfig") -> bool:
        """Whether it serves on CPUs (no GPU resource in the manifests)."""
        return not self.gpu_only

    def docker_stage(self, cfg: "PipelineConfig") -> str:
        """The Dockerfile stage (target) whose image serves it."""
        raise NotImplementedError

    def alert_engine(self, cfg: "PipelineConfig") -> tuple[str, bool]:
        """(whose series the alert rules read: "triton" or "vllm", whether the GPU rules apply)."""
        return "triton", not self.on_cpu(cfg)

    def requirements(self, cfg: "PipelineConfig") -> tuple[str, ...]:
        """What this machine must have to build and serve it (NEEDS_*): the base answers from the servers of its
        frontends and, for a GPU-only target, a GPU and TensorRT-LLM (with trtllm-build for an engine per rank)."""
        needs = [n for f in self.frontends(cfg) for n in SERVER_NEEDS[self.server(f)]]
        if self.gpu_only:
            needs += [NEEDS_GPU, NEEDS_TRTLLM] + ([NEEDS_TRTLLM_BUILD] if self.engine_per_rank else [])
        return tuple(dict.fromkeys(needs))

    def device_hand_over(self, publish_dir: Path) -> str:
        """Where a device-only target's published build is and what to run on the device (device_only)."""
        return ""

    def kv_offloading_gib(self, cfg: "PipelineConfig") -> Optional[float]:
        """The host-memory KV tier it keeps, in GiB over all ranks (None: none)."""
        return None

    def host_kv_cache_gib(self, cfg: "PipelineConfig") -> int:
        """The KV cache it keeps in host memory when it serves on CPUs, in GiB (0: inside its own runtime's
        sizing)."""
        return 0

    def serves_format(self, weight_format: str, setting: Callable[[str], Any]) -> bool:
        """Whether it serves layers in ``weight_format``; ``setting(dotted)`` reads the config's value of a field
        (the merged YAML before validation, its schema default where unset)."""
        return True

    def tenant_pool_blocks(self, triton: Any, build: Any) -> Optional[int]:
        """The KV blocks the tenants' shares divide, as the config sets them (the runtime holds ``max_running`` or
        ``max_batch_size`` sequences of ``max_seq_len``); None where the engine sizes its pool as it starts (vLLM:
        shares are then fractions, resolved against the pool at load)."""
        per_sequence = -(-build.max_seq_len // build.kv_cache.tokens_per_block)
        return int((triton.max_running or build.max_batch_size) * per_sequence)

    def serving_setting_note(self, key: str) -> str:
        """Why its runtime has no ``key`` of SERVING_SETTINGS, and what it has instead ("" when nothing to add)."""
        return ""

    def apply_serving_settings(self, triton: Any, served: Path, tenants: Sequence[Any] = ()) -> None:
        """Publish, after linking the build's artifact folder into the repository as ``served``: apply the triton
        section's serving settings, and the config's ``tenants`` where a server outside Triton reads them, to what
        the server reads there (the vllm target's engine record); a file changed is replaced by one of its own,
        never written through the link into the build."""

    def missing_artifacts(self, artifact: Path) -> list[str]:
        """What a build folder of this target lacks (publish refuses it)."""
        return [f for f in self.artifact_files if not (artifact / f).is_file()]

    def llm_model(self, triton: Any, settings: BuildSettings, *, serving_root: str, llm_model: str, preprocessing: str,
                  version: int, adaptive_target_ms: Optional[float]) -> tuple[dict[str, Any], int, str]:
        """The engine model's Triton parameters, instance count and kind (``KIND_CPU``, ``KIND_MODEL``): what
        publish writes into its config.pbtxt. ``settings``: the build's build_settings.json; the paths name
        where the repository is served from (``serving_root``) and the model folders."""
        raise NotImplementedError

    # ---------------------------------------------------------------- entry points

    def call(self, entry: str, *args: Any, **kwargs: Any) -> Any:
        """Import and call one of the target's entry points (``build_entry``, ``preflight_entry``)."""
        return resolve_entry(entry)(*args, **kwargs)


def priority_parameters(triton: Any) -> dict[str, int]:
    """The request classes as the Python engine models read them (triton_repo/common/llm_serving.py); 0: one
    class."""
    return {"priority_levels": triton.priority_levels or 0,
            "default_priority_level": triton.default_priority_level or triton.priority_levels or 0}


def tenant_parameters(tenants: Any) -> dict[str, str]:
    """The config's tenants as the Python engine models read them (a JSON list; triton_repo/common/llm_serving.py):
    none, no parameter."""
    import json

    return {"tenants": json.dumps([x.model_dump(exclude_none=True) for x in tenants])} if tenants else {}


def watchdog_parameters(triton: Any) -> dict[str, float]:
    """The serving model's watchdog limits (triton_repo/common/llm_watchdog.py; 0: that signal off)."""
    w = triton.watchdog
    return {"watchdog_errors_per_minute": w.errors_per_minute, "watchdog_memory_mb_per_s": w.memory_mb_per_s,
            "watchdog_memory_window_s": w.memory_window_s}


def resolve_entry(entry: str) -> Callable[..., Any]:
    """The function a ``module:function`` path names."""
    module, _, attr = entry.partition(":")
    return getattr(importlib.import_module(module), attr)
