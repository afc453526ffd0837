"""One published build under load: its repository and build settings, the server answering for it, its levels.

Per level this joins the client's figures (``load``), the padding factor where the build says how batches
are padded (``stats``), and Triton's own counters read before and after the level (``metrics``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipeline import artifacts, records
from pipeline.config import BenchSection
from pipeline.errors import InputError, StageFailed
from pipeline.serving.bench.cpu import cpu_by_role, per_token
from pipeline.serving.bench.load import Prompt, RequestRecord, drive, drive_openai, level_figures
from pipeline.serving.bench.metrics import answered, metrics_delta, scrape_metrics, scrape_settled
from pipeline.serving.bench.stats import padding_factor
from pipeline.serving.publish import ModelNames, model_names
from pipeline.serving.server import TritonServer

log = logging.getLogger(__name__)


@dataclass
class Target:
    """A published repository being benchmarked, and the server answering for it."""

    label: str  # "this build" / "baseline" (a vllm build served two ways: "this build (openai)", ...)
    repository: Path
    provenance: records.Provenance
    settings: Optional[records.BuildSettings]  # build_settings.json, when known
    frontend: str = "triton"  # a vllm build: "openai" (vLLM's own server) or "triton" (its Python-backend model)
    grpc_url: str = ""
    http_url: str = ""  # host:port of the server bench started (the open-loop load's endpoint)
    metrics_url: Optional[str] = None
    server: Optional[TritonServer] = None
    levels: list[dict] = field(default_factory=list)
    rates: list[dict] = field(default_factory=list)  # the open-loop load's figures, one per request rate

    @property
    def names(self) -> ModelNames:
        return model_names(self.provenance.model_name)

    @property
    def openai(self) -> bool:
        """Served by vLLM's OpenAI server (a vllm build's "openai" frontend), not by Triton."""
        return self.frontend == "openai"

    @property
    def tokenizer_dir(self) -> Path:
        """The tokenizer the preprocessing model uses (a vllm build's export carries the same files)."""
        p = self.provenance
        return self.repository / self.names.preprocessing / str(p.version) / artifacts.TOKENIZER_DIR

    def describe(self) -> dict:
        """What was benchmarked, and on which server, as the results record it."""
        p = self.provenance
        return {"label": self.label, "repository": str(self.repository), "config_name": p.config_name,
                "model_name": p.model_name, "version": p.version, "quantization": p.quantization.model_dump(),
                "target": p.build.target, "frontend": self.frontend, "repository_digest": p.repository_digest,
                "server": "started by bench" if self.server is not None else f"existing server at {self.grpc_url}"}


# ---------------------------------------------------------------- reading a published build


def read_repository(path: Path) -> tuple[Path, records.Provenance]:
    """A published repository, given it or the work dir that holds it: (repository, its provenance)."""
    for candidate in (path, artifacts.published_repository(path), path / artifacts.MODEL_REPOSITORY_DIR):
        if (candidate / artifacts.PROVENANCE_FILE).is_file():
            return candidate, records.read_provenance(candidate)
    raise InputError(f"{path} is not a published model repository (no readable provenance.json there or in "
                     f"publish/model_repository under it); run `invoke publish` for that build first")


def build_dir_of(repository: Path) -> Optional[Path]:
    """The build stage folder of the work dir a publish snapshot lies in; None for any other repository."""
    work_dir = repository.parent.parent
    if artifacts.published_repository(work_dir) != repository:
        return None
    return artifacts.stage_dir(work_dir, "build")


def build_settings(build_dir: Optional[Path]) -> Optional[records.BuildSettings]:
    """The build's settings, where there is a build folder with build_settings.json in it."""
    if build_dir is None or not (build_dir / artifacts.BUILD_SETTINGS_FILE).is_file():
        return None
    return records.read_build_settings(build_dir)


# ---------------------------------------------------------------- checks before any load


def check_lengths(cfg: BenchSection, settings: Optional[records.BuildSettings], label: str) -> None:
    """The prompt and the generated tokens must fit the build's limits (``settings``), where they are known."""
    if settings is None:
        return
    if cfg.prompt_tokens > settings.max_input_len or cfg.prompt_tokens + cfg.output_tokens > settings.max_seq_len:
        raise InputError(
            f"bench.prompt_tokens {cfg.prompt_tokens} + output_tokens {cfg.output_tokens} do not fit "
            f"{label}'s limits (max_input_len {settings.max_input_len}, max_seq_len "
            f"{settings.max_seq_len}); lower them"
        )


def check_served(target: Target) -> None:
    """An existing server must serve the published version of every model this build publishes."""
    import tritonclient.grpc as grpcclient  # optional and heavy (gRPC stubs): only when a server is asked

    version = str(target.provenance.version)
    client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        missing = [m for m in target.names.all() if not client.is_model_ready(m, version)]
    except Exception as e:  # noqa: BLE001 - any failure to ask is a server we cannot use
        raise InputError(f"bench.grpc_url {target.grpc_url}: cannot ask the server which models are ready ({e}); "
                         f"check the address, or drop bench.grpc_url to start a server here") from None
    finally:
        client.close()
    if missing:
        raise InputError(f"the server at bench.grpc_url {target.grpc_url} does not serve version {version} (the "
                         f"published one) of {', '.join(sorted(set(missing)))}; load that repository there, or "
                         f"drop bench.grpc_url to start a server on it here")


# ---------------------------------------------------------------- load


def _send(target: Target, prompts: list[Prompt], concurrency: int,
          cfg: BenchSection) -> tuple[list[RequestRecord], float]:
    """Every prompt to the target's streaming model (vLLM: streamed completions), ``concurrency`` in flight:
    (records, wall seconds)."""
    if target.openai:
        server: Any = target.server  # a VllmServer: bench starts one for a vllm target
        return drive_openai(server.base_url, server.model_name, prompts=prompts, concurrency=concurrency,
                            max_tokens=cfg.output_tokens, ignore_eos=cfg.ignore_eos, timeout_s=cfg.request_timeout_s)
    return drive(target.grpc_url, target.names.stream, prompts=prompts, concurrency=concurrency,
                 max_tokens=cfg.output_tokens, end_id=-1 if cfg.ignore_eos else None, timeout_s=cfg.request_timeout_s)


def _raise_on_errors(target: Target, records: list[RequestRecord], what: str) -> None:
    failed = [r.error for r in records if r.error is not None]
    if failed:
        raise StageFailed(f"bench ({target.label}, {what}): {len(failed)} of {len(records)} request(s) failed; "
                          f"first error: {failed[0]}.")


def warm_up(target: Target, prompts: list[Prompt], concurrency: int, cfg: BenchSection) -> None:
    """Unmeasured requests before the sweep (none: nothing to do)."""
    if not prompts:
        return
    records, wall = _send(target, prompts, concurrency, cfg)
    _raise_on_errors(target, records, "warm-up")
    log.info("%s: warm-up of %d request(s) in %.1f s", target.label, len(records), wall)


def run_level(target: Target, prompts: list[Prompt], concurrency: int, cfg: BenchSection,
              sla: Optional[dict[str, float]] = None) -> dict:
    """One measured level: the client's figures (with goodput against ``sla``'s bounds), the padding factor and
    what Triton counted meanwhile."""
    models = target.names.all()
    before = scrape_metrics(target.metrics_url)
    pid = target.server.pid if target.server is not None else None  # a server bench started: its CPU is read
    cpu_before = cpu_by_role(pid) if pid else None
    records, wall = _send(target, prompts, concurrency, cfg)
    _raise_on_errors(target, records, f"concurrency {concurrency}")
    if target.openai:  # vLLM's own metrics: none of Triton's counters to read
        after = scrape_metrics(target.metrics_url)
    else:
        stream = target.names.stream
        after = scrape_settled(target.metrics_url, stream, answered(before, stream) + len(records))
    fig = level_figures(records, wall, concurrency, sla)
    fig["padding_factor"] = padding_factor(target.settings, concurrency)
    fig["triton"] = metrics_delta(before, after, models)
    if cpu_before is not None and pid:  # after the counters settled: the engine is done with this level
        fig["cpu_ms_per_token"] = per_token(cpu_before, cpu_by_role(pid), fig["output_tokens"],
                                            None if target.openai else target.names.tensorrt_llm)
    log.info("%s c=%d: %.1f tok/s, %.2f req/s, TTFT p50 %.0f ms, ITL p50 %.1f ms, e2e p50/p99 %.0f/%.0f ms",
             target.label, concurrency, fig["output_tokens_per_s"], fig["requests_per_s"], fig["ttft_ms"]["p50"],
             fig["itl_ms"].get("p50", float("nan")), fig["e2e_ms"]["p50"], fig["e2e_ms"]["p99"])
    return fig
