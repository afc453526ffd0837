"""The edge target's entry points (pipeline.targets.edge): preflight, build and publish.

The build runs Edge-LLM's host export (``tensorrt-edgellm-export``, in its own environment) on the HF unified
checkpoint with the model's tokenizer and chat template beside it, reads the export back (worker.py: ONNX checker,
inputs and outputs, every linear's codes and scales against the checkpoint, the checkpoint through Edge-LLM's own
Python API), refuses an export whose layer formats are not the plan's, and writes the device files (device.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from pipeline import artifacts, records, targets
from pipeline.child import log_tail
from pipeline.engines.build import NO_CUDA_GRAPHS, build_settings, checkpoint_sha256
from pipeline.engines.edgellm import device, env
from pipeline.errors import InputError, StageFailed
from pipeline.formats import EDGE_INT4_ALIGN, HIGH_PRECISION
from pipeline.procs import foreign_python_env, run_group
from pipeline.summaries import BuildSummary, PublishSummary

WORKER = Path(__file__).with_name("worker.py")
EXPORT_TIMEOUT_S = 3600
DEVICE_PROMPTS = ("The capital of France is", "Write a haiku about the sea.")
DEVICE_NEW_TOKENS = 32


def preflight(loaded) -> None:
    """Stop before any work where the export environment is missing (the config rules ran at load)."""
    env.export_python()


def _run(argv: list[str], what: str, log_path: Path, timeout_s: float) -> None:
    code = run_group(argv, what, log_path=log_path, env=foreign_python_env(), timeout_s=timeout_s)
    if code:
        raise StageFailed(f"{what} failed (exit {code}); the end of {log_path}:\n{log_tail(log_path)}")


def export_input(ckpt_dir: Path, model_dir: Path, dest: Path) -> Path:
    """The folder the export reads: the checkpoint's files linked, the model's tokenizer files and chat template
    linked beside them (the export writes the runtime's tokenizer and template from there; the checkpoint's
    config.json, with its quantization, is the one kept)."""
    for f in ckpt_dir.iterdir():
        (dest / f.name).symlink_to(f.resolve())
    for name in artifacts.TOKENIZER_FILES:
        if (model_dir / name).is_file() and not (dest / name).exists():
            (dest / name).symlink_to((model_dir / name).resolve())
    return dest


def has_chat_template(model_dir: Path) -> bool:
    """Whether the model carries a chat template, which Edge-LLM's export writes for its runtime (for the families
    of this pipeline it has no renderer of its own: tensorrt_edgellm/chat_template.py write_chat_template)."""
    if (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file():
        return True
    tok = model_dir / "tokenizer_config.json"
    return tok.is_file() and bool(json.loads(tok.read_text()).get("chat_template"))


def misaligned_int4(ckpt_dir: Path, planned: dict[str, str]) -> list[str]:
    """The planned INT4 layers Edge-LLM's INT4 GEMM plugin cannot take: out or in features not a multiple of
    EDGE_INT4_ALIGN (the checkpoint stores an INT4 weight as uint8 [out / 2, in])."""
    from safetensors import safe_open

    shapes = {}
    for shard in sorted(ckpt_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="np") as f:
            shapes.update({k: f.get_slice(k).get_shape() for k in f.keys() if k.endswith(".weight")})
    bad = []
    for layer, fmt in planned.items():
        shape = shapes.get(f"{layer}.weight")
        if fmt == "int4_awq" and shape is not None:
            out_features, in_features = 2 * shape[0], shape[1]
            if out_features % EDGE_INT4_ALIGN or in_features % EDGE_INT4_ALIGN:
                bad.append(f"{layer} ({out_features} x {in_features})")
    return bad


def read_back(python: str, onnx_path: Path, ckpt_dir: Path, log_path: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="edgellm-check-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps({"onnx": str(onnx_path), "checkpoint": str(ckpt_dir)}))
        _run([python, str(WORKER), str(req), str(res)], "the Edge-LLM export's read-back", log_path, 1800)
        return json.loads(res.read_text())


def plan_formats(plan_file: Path) -> dict[str, str]:
    """Each planned layer's format (a layer the plan does not list, such as a tied lm_head, stays high precision)."""
    return {name: layer.format for name, layer in records.read_plan(plan_file).layers.items()}


def compare(check: dict, planned: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(each layer's format as read from the export, what differs from the plan or the checkpoint)."""
    found, problems = {}, []
    for layer, got in check["layers"].items():
        fmt = got.get("format")
        found[layer] = fmt
        if fmt is None:
            problems.append(f"{layer}: {got.get('why')}")
            continue
        want = planned.get(layer, HIGH_PRECISION)
        if want != fmt:
            problems.append(f"{layer}: the plan says {want}, the export holds {fmt}")
        bad = [k for k, v in got.items() if k.endswith("_match") and v is False]
        if bad:
            problems.append(f"{layer}: {', '.join(b[:-len('_match')] for b in bad)} differ from the checkpoint's")
    return found, problems


def build_stage(ctx, ckpt_dir: Path, hf_checkpoint: bool = False) -> BuildSummary:
    """Export, read back, write the device bundle and build_settings.json."""
    from pipeline.targets.edge import platform_of

    t0 = time.perf_counter()
    cfg, out = ctx.config, ctx.out_dir
    platform = platform_of(cfg.build.target_sm)
    assert platform is not None  # EdgeTarget.check refused any other build.target_sm at load
    python = env.export_python()
    log_path = out / artifacts.STAGE_LOG_FILE
    bundle = out / artifacts.EDGE_BUNDLE_DIR
    onnx_dir = bundle / artifacts.EDGE_ONNX_DIR
    model_dir = ctx.upstream("model") / artifacts.MODEL_DIR
    if not has_chat_template(model_dir):
        raise InputError(f"the model in {model_dir} has no chat template (chat_template.jinja, or chat_template in "
                         f"tokenizer_config.json): TensorRT Edge-LLM's export writes one for its runtime and refuses "
                         f"a model without it. Use the model's instruct / chat variant, or add its template there")
    planned = plan_formats(ctx.work_dir / "plan" / artifacts.PLAN_FILE)
    misaligned = misaligned_int4(ckpt_dir, planned)
    if misaligned:
        raise InputError(f"{len(misaligned)} INT4 layer(s) of the plan are not {EDGE_INT4_ALIGN}-aligned, which "
                         f"TensorRT Edge-LLM's INT4 GEMM plugin needs (out and in features multiples of "
                         f"{EDGE_INT4_ALIGN}): {', '.join(misaligned[:6])}. Keep them in high precision with a plan "
                         f"rule (with the layers they are fused with: q/k/v, gate/up), or use weight_format int8_sq")
    with tempfile.TemporaryDirectory(prefix="edgellm-input-", dir=out) as tmp:
        src = export_input(ckpt_dir, model_dir, Path(tmp))
        _run([env.export_command(python), str(src), str(onnx_dir)], "tensorrt-edgellm-export", log_path,
             EXPORT_TIMEOUT_S)
    t_export = time.perf_counter() - t0
    check = read_back(python, onnx_dir / "llm" / "model.onnx", ckpt_dir, log_path)
    check["formats"], problems = compare(check, planned)
    (out / artifacts.EDGE_CHECK_FILE).write_text(json.dumps(check, indent=1) + "\n")
    if problems:
        raise InputError(f"the Edge-LLM export does not hold the plan's layers as planned "
                         f"({len(problems)} problem(s); {out / artifacts.EDGE_CHECK_FILE} has the details): "
                         + "; ".join(problems[:5]))
    b = cfg.build
    limits = {"max_batch_size": b.max_batch_size, "max_input_len": b.max_input_len, "max_seq_len": b.max_seq_len,
              "max_new_tokens": DEVICE_NEW_TOKENS}
    manifest = device.write_device_files(bundle, platform, limits, list(DEVICE_PROMPTS), check)
    ckpt_hash = checkpoint_sha256(ckpt_dir)
    settings = build_settings(cfg, "edge", artifact_dir=artifacts.EDGE_BUNDLE_DIR, kv_algo=None,
                              cuda_graphs=NO_CUDA_GRAPHS, trtllm_version=None,
                              provenance={"tensorrt_edgellm": env.edgellm_version(python),
                                          "platform": platform.name, "jetpack": platform.jetpack},
                              ckpt_hash=ckpt_hash)
    records.write_build_settings(out, settings)
    return {"target": "edge", "platform": platform.name, "jetpack": platform.jetpack,
            "tensorrt_edgellm": manifest["tensorrt_edgellm"], "checkpoint_sha256": ckpt_hash,
            "layer_formats": dict(Counter(check["formats"].values())), "custom_ops": check["custom_ops"],
            "kv_cache_dtype": manifest["engine"]["kv_cache_dtype"], "onnx_bytes": _size(onnx_dir),
            "export_s": round(t_export, 1), "timing_s": round(time.perf_counter() - t0, 1)}


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link where the two folders share a file system (the build's files are never rewritten in place: a
    rebuild replaces the folder), a copy elsewhere."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def publish_stage(ctx) -> PublishSummary:
    """The device bundle, as the build left it, into the publish stage's folder (what is copied to the device)."""
    build = ctx.upstream("build")
    settings = records.read_build_settings(build)
    lacking = targets.get(settings.target).missing_artifacts(build / settings.artifact_dir)
    if lacking:
        raise InputError(f"the edge build in {build} lacks {', '.join(lacking)}: rerun `invoke build --force`")
    dest = ctx.out_dir / artifacts.EDGE_BUNDLE_DIR
    shutil.copytree(build / settings.artifact_dir, dest, copy_function=_link_or_copy)  # the weights: hundreds of MB
    shutil.copy2(build / artifacts.EDGE_CHECK_FILE, dest / artifacts.EDGE_CHECK_FILE)
    manifest = json.loads((dest / artifacts.EDGE_MANIFEST_FILE).read_text())
    return {"target": "edge", "bundle": str(dest), "bundle_bytes": _size(dest), "platform": manifest["platform"],
            "jetpack": manifest["jetpack"], "device_commands": manifest["device_commands"]}
