"""The build stage on the embedded default (SmolLM2-135M, INT8 SmoothQuant + INT8 KV): the cpu bundle, and
the reference runtime's greedy tokens against the checkpoint-rebuilt model, solo and 8 at once; then the
published repository served and its run killed: no model process may outlive it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import kill_the_starter, memory_cgroup, needs_memory_cgroup, run_invoke

from pipeline.engines import reference
from pipeline.engines.cpu_runtime import CpuRuntime, SamplingParams

# The default's build (sensitivity and quantize of SmolLM2) runs inside the first test's time: 144 s on a usual
# machine, over 25 minutes on a slow, shared one (seen); its limit is the default end-to-end tests' hour.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]
NAME = "smollm2-135m-cpu"
PROMPTS = ["The capital of France is", "A function in Python is defined with", "Once upon a time,",
           "The three primary colors are", "To sort a list in Python you can", "Water boils at",
           "The largest planet in the solar system is", "def fibonacci(n):"]
NEW_TOKENS = 16
CAP = 850 * 2**20  # anonymous memory measured in the runtime: streamed 0.58 GB, resident 1.15 GB


@pytest.fixture(scope="module")
def built(default_work_root):
    proc = run_invoke("build", "--work-root", str(default_work_root), timeout=3600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return default_work_root / NAME / "build"


@pytest.fixture(scope="module")
def prompt_ids(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built / "cpu_bundle" / "model")
    return [tok(p).input_ids for p in PROMPTS]


def test_bundle_settings_and_smoke_test(built):
    settings = json.loads((built / "build_settings.json").read_text())
    assert settings["target"] == "cpu" and settings["kv_cache"]["quant_algo"] == "INT8"
    assert settings["kv_cache"]["tokens_per_block"] == 32 and settings["trtllm_version"] is None
    smoke = json.loads((built / "manifest.json").read_text())["summary"]["smoke_test"]
    assert "Paris" in smoke["output"]


def test_unquantized_cache_runtime_equals_the_rebuilt_checkpoint_model(built, prompt_ids):
    """The quantize stage's read-back model, decoded plainly, vs the runtime with its cache kept in fp32."""
    model, _, _ = reference.load_reference(built / "cpu_bundle")
    with CpuRuntime.load(built / "cpu_bundle", quantize_kv_cache=False) as rt:
        for ids in prompt_ids[:4]:
            got = rt.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS))
            want = reference.greedy(model, ids, max_new_tokens=NEW_TOKENS, end_id=rt.eos_token_id)
            assert reference.compare(got, want)["ok"], (got, want.tokens)


def test_int8_cache_runtime_solo_and_eight_at_once(built, prompt_ids):
    model, algo, scales = reference.load_reference(built / "cpu_bundle")
    assert algo == "INT8"
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    with CpuRuntime.load(built / "cpu_bundle") as rt:
        solo = [rt.generate(ids, params) for ids in prompt_ids]
        before = dict(rt.steps)
        requests = [rt.submit(ids, params) for ids in prompt_ids]
        together = [r.result(timeout=300) for r in requests]
        eos = rt.eos_token_id
        steps = {k: rt.steps[k] - before[k] for k in before}
        assert steps["decode_sequences"] > 4 * steps["decode"]  # the 8 really ran batched (~8 per step)
    report = []
    for ids, s, t in zip(prompt_ids, solo, together):
        want = reference.greedy(model, ids, max_new_tokens=NEW_TOKENS, kv_quant_algo=algo, kv_scales=scales, end_id=eos)
        solo_check, together_check = reference.compare(s, want), reference.compare(t, want)
        report.append((solo_check, together_check))
        # one sequence alone: the same arithmetic as the reference, token for token
        assert solo_check["ok"], (s, want.tokens, solo_check)
        # batched: equal to its solo run, or the first difference is a float-rounding tie of the reference
        assert t == s or together_check["ok"], (t, s, want.tokens, together_check)
    assert sum(a["equal"] for a, _ in report) >= 6


def test_a_killed_run_leaves_no_model_process_and_the_next_run_clears_its_leftovers(built, default_work_root):
    """kill -9 of the process that started a server (as of `invoke verify`) while requests are in flight: the
    server dies with it, and so must the stub holding the loaded runtime (without llm_io.exit_with_server it
    stayed, an orphan of 1.26 GB); its shared memory and temporary folder go at the next server start."""
    from pipeline.serving.server import SHM_DIR, remove_stale_leftovers

    proc = run_invoke("publish", "--work-root", str(default_work_root), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    repo = default_work_root / NAME / "publish" / "model_repository"
    facts, left = kill_the_starter(f"""
        import json, threading, time, urllib.request
        from pathlib import Path
        from pipeline.serving.server import TritonServer
        s = TritonServer(Path({str(repo)!r})).start()
        def ask():
            body = json.dumps({{"text_input": "Tell me a long story. " * 8, "max_tokens": 64}}).encode()
            while True:
                try:
                    urllib.request.urlopen(urllib.request.Request(
                        f"http://{{s.http_url}}/v2/models/smollm2/generate", data=body, method="POST"), timeout=120)
                except Exception:
                    pass
        for _ in range(4):
            threading.Thread(target=ask, daemon=True).start()
        time.sleep(2)
        print(json.dumps({{"pid": s.pid, "prefix": s.shm_prefix, "tmp": str(s._tmp)}}), flush=True)
        time.sleep(600)
        """, wait_s=20)
    assert left == [], "a model's stub outlived the run that started its server"
    leftovers = list(SHM_DIR.glob(facts["prefix"] + "*")) + [Path(facts["tmp"])]
    # the next server start removes what is left, if the group's reaper (pipeline.reaper) has not already; the
    # reaper may be removing the same files at that moment (a slower one on a busy machine), so give it its time
    deadline = time.monotonic() + 30
    while True:
        remove_stale_leftovers()
        left_paths = [p for p in leftovers if p.exists()]
        if not left_paths or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left_paths, left_paths


def test_streamed_layers_give_the_resident_weights_tokens(built, prompt_ids):
    """Layer streaming (for a model larger than memory: each decoder layer is read from the checkpoint when a
    forward reaches it, then dropped) computes what the resident weights compute: the same greedy tokens,
    8 sequences batched; no decoder layer holds a weight between forwards."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS)

    def batched(rt):
        requests = [rt.submit(ids, params) for ids in prompt_ids]
        return [r.result(timeout=600) for r in requests]

    with CpuRuntime.load(built / "cpu_bundle", layer_streaming="never") as rt:
        assert not rt.layer_streaming
        want = batched(rt)
    with CpuRuntime.load(built / "cpu_bundle", layer_streaming="always") as rt:
        assert rt.layer_streaming
        assert batched(rt) == want
        held = [n for n, p in rt.model.model.layers.named_parameters() if not p.is_meta]
        assert held == []
        assert not any(p.is_meta for p in rt.model.model.embed_tokens.parameters())


@needs_memory_cgroup
def test_under_a_cap_the_resident_runtime_is_killed_and_the_streamed_one_serves(built, prompt_ids, tmp_path):
    """A real memory cap between the two: the kernel kills the runtime that holds SmolLM2's 0.5 GiB of fp32
    weights; the streamed one, in the same cap, gives the uncapped runtime's tokens."""
    from child_targets import generate_in_cgroup

    from pipeline.child import run_in_child
    from pipeline.errors import StageFailed

    bundle, prompts = str(built / "cpu_bundle"), prompt_ids[:4]
    with CpuRuntime.load(bundle, layer_streaming="never") as rt:
        requests = [rt.submit(p, SamplingParams(max_new_tokens=8)) for p in prompts]
        want = [r.result(timeout=600) for r in requests]
    with memory_cgroup(CAP) as cg:
        (got, streamed), _ = run_in_child(generate_in_cgroup, str(cg), bundle, "always", prompts, 8,
                                             log_path=tmp_path / "streamed.log")
        assert streamed and got == want
        with pytest.raises(StageFailed, match="memory"):
            run_in_child(generate_in_cgroup, str(cg), bundle, "never", prompts, 8, log_path=tmp_path / "resident.log")


@needs_memory_cgroup
def test_auto_streams_in_a_small_cgroup_and_refuses_one_too_small_for_a_layer(built, prompt_ids, tmp_path):
    """``layer_streaming: auto`` finds the serving process's bound itself (its cgroup's limit less what the
    cgroup holds): in the cap above it streams; in 400 MiB, where not even the embedding, one layer, the
    pool and the libraries fit, it refuses before loading anything, naming the sizes."""
    from child_targets import generate_in_cgroup

    from pipeline.child import run_in_child
    from pipeline.errors import InputError

    bundle, prompts = str(built / "cpu_bundle"), prompt_ids[:1]
    with memory_cgroup(CAP) as cg:
        (_, streamed), _ = run_in_child(generate_in_cgroup, str(cg), bundle, "auto", prompts, 2,
                                        log_path=tmp_path / "auto.log")
    assert streamed
    with memory_cgroup(400 * 2**20) as cg:
        with pytest.raises(InputError, match=r"needs at least [0-9.]+ GiB to serve even one decoder layer"):
            run_in_child(generate_in_cgroup, str(cg), bundle, "auto", prompts, 2, log_path=tmp_path / "tiny.log")
