"""Shared fixtures: a tiny real Llama model (random weights, real tokenizer) and helpers to run invoke."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The embedded default on the cpu target (Triton + the reference runtime): what the end-to-end chain of tests
# (download -> ... -> verify, default_work_root) builds, and what every other test config extends. The
# project's own default (pipeline.constants.DEFAULT_CONFIG) serves the same plan through vLLM:
# tests/engines/vllm/test_vllm.py.
DEFAULT_CONFIG = REPO / "engine_configs" / "smollm2-135m-cpu.yaml"


def run_invoke(*args: str, env: dict | None = None, timeout: float = 600, cwd: Path = REPO):
    """Run `invoke ARGS` as a user would (a fresh process), capturing its output. Without ``--config`` the task
    gets DEFAULT_CONFIG (the cpu target) named explicitly."""
    if args and args[0] != "test" and "--config" not in args:
        args = (args[0], "--config", str(DEFAULT_CONFIG), *args[1:])
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


# set in a run's environment: every process it starts inherits it, so what it left can be found exactly
RUN_TOKEN_ENV = "PIPELINE_FAULT_RUN"


def run_processes(token: str) -> list[int]:
    """Live processes of a run: those whose environment holds ``RUN_TOKEN_ENV=token``, which everything the run
    starts inherits (vLLM's engine core and resource tracker, Triton's stubs, the reapers), reparented or not.
    Not "every process whose command line or open files point into the repository, its environments or the
    work root": on a machine shared with other runs that counted theirs too (a tool another session ran on
    this test's work root, the script running this check); the token is that check made exact."""
    mark = f"{RUN_TOKEN_ENV}={token}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark in env:
            out.append(int(entry.name))
    return out


def kill_the_starter(code: str, wait_s: float = 30) -> tuple[dict, list[int]]:
    """Run ``code`` in a fresh interpreter (it starts a server and prints one JSON line with the server's
    ``pid``), kill -9 that interpreter, and wait up to ``wait_s`` for the server's process group to die.
    Returns (the printed facts, the group's processes still alive; this helper has killed them)."""
    import signal
    import time

    from pipeline.procs import group_members

    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
    try:
        facts = json.loads(parent.stdout.readline())
    finally:
        parent.kill()  # SIGKILL: no clean-up code runs in it
        parent.wait()
    deadline = time.monotonic() + wait_s
    while group_members(facts["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = group_members(facts["pid"])
    if left:  # the test started them: they end here, and the test fails on what it got
        os.killpg(facts["pid"], signal.SIGKILL)
    return facts, left


CGROUP_V1 = Path("/sys/fs/cgroup/memory")
needs_memory_cgroup = pytest.mark.skipif(
    os.geteuid() != 0 or not (CGROUP_V1 / "cgroup.procs").is_file(),
    reason="needs root and the cgroup v1 memory controller (as on the CI machines)")


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A new memory cgroup under this process's own, its limit enforced by the kernel; yields its folder (a
    child joins it by writing its pid to ``cgroup.procs``) and removes it once its processes are gone."""
    import time
    import uuid

    own = Path("/proc/self/cgroup").read_text()
    parent = CGROUP_V1 / next(line.split(":", 2)[2] for line in own.splitlines()
                              if "memory" in line.split(":")[1].split(",")).lstrip("/")
    cg = parent / f"pipeline-test-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(limit_bytes))
        if (cg / "memory.memsw.limit_in_bytes").exists():  # no swapping past the cap either
            (cg / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        yield cg
    finally:
        for _ in range(50):  # a killed child leaves the cgroup as the kernel reaps it
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def sigint_at_default() -> None:
    """``preexec_fn`` for a command a test stops with Ctrl-C (SIGINT), as a terminal's foreground command gets it.
    A shell that starts a command in the background without job control (``cmd &`` in a script, or a run under
    setsid) hands it SIGINT ignored; Python then installs no KeyboardInterrupt handler, and the signal does nothing
    (seen: a whole suite started so had every Ctrl-C test time out)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_until(proc, marker: str, timeout_s: float) -> list[str]:
    """Lines a process prints (``stdout=PIPE, text=True``) up to the first holding ``marker``, or until it
    closes its output or ``timeout_s`` passes."""
    import time

    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            break
    return lines


def write_yaml(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def tree_snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file and folder under root: equal snapshots mean nothing was touched."""
    if not root.exists():
        return {}
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        out[p.relative_to(root).as_posix()] = (st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return out


# How `invoke test` spreads the suite over the CPUs (pytest-xdist, ``--dist loadgroup``): a test file is one unit of
# work, so its module fixtures are built once, on one worker. Two exceptions:
# - every test on the session's default work root is one unit, DEFAULT_MODEL_GROUP, since each of its stages reuses
#   the one before (download -> sensitivity -> quantize -> build -> verify, and the vllm target from the same
#   checkpoint);
# - a file that sets GROUP_PER_PARAM to the name of a parametrized module fixture is one unit per value of it (each
#   value is a chain of its own: tests/test_families.py's families).
# Units are queued longest first as far as collection can tell: the default chain, then by the number of tests that
# are not unit tests (those run no model and start no server).
DEFAULT_MODEL_GROUP = "default_model"


def _group(item) -> str:
    if "default_work_root" in item.fixturenames:  # the fixtures it needs, directly or not
        return DEFAULT_MODEL_GROUP
    file = item.nodeid.split("::")[0]
    by = getattr(item.module, "GROUP_PER_PARAM", None)
    callspec = getattr(item, "callspec", None)
    if by and callspec is not None and by in callspec.params:
        file = f"{file}::{callspec.params[by]}"
    # xdist reads the group back from after the nodeid's last "@", and only where no "]" follows it
    return file.replace("@", "_").replace("]", ")").replace("[", "(")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the group marks into work units
def pytest_collection_modifyitems(config, items):
    weight: dict[str, int] = {}
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
        group = item.get_closest_marker("xdist_group").args[0]
        weight[group] = weight.get(group, 0) + (item.get_closest_marker("unit") is None)
    weight[DEFAULT_MODEL_GROUP] = len(items) + 1
    items.sort(key=lambda item: -weight[item.get_closest_marker("xdist_group").args[0]])  # stable: file order kept


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A real byte-level BPE tokenizer trained on standard-library prose (a second or so)."""
    from pydoc_data import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(topics.topics.values())[:20], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>", clean_up_tokenization_spaces=False)
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A 2-layer Llama with random weights saved as a normal HF folder (safetensors + tokenizer)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny_model")
    model.save_pretrained(out, safe_serialization=True)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy2(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def default_work_root(tmp_path_factory) -> Path:
    """`invoke download` on the embedded default config, once per test session (about 40 s)."""
    work_root = tmp_path_factory.mktemp("default_work")
    proc = run_invoke("download", "--work-root", str(work_root), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "model: done" in proc.stdout and "text: done" in proc.stdout
    return work_root


@pytest.fixture(scope="session")
def outlier_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with one input channel of layer 1's attention inputs blown up x300 and the matching
    weight columns of q/k/v shrunk /300: the same function, but with the kind of activation outlier channel
    that wrecks per-tensor INT8 activations (and that SmoothQuant exists to fix)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("outlier_model")
    for f in tiny_model_dir.iterdir():
        shutil.copy2(f, out / f.name)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.layers.1.input_layernorm.weight"][7] *= 300.0
    for m in "qkv":
        tensors[f"model.layers.1.self_attn.{m}_proj.weight"][:, 7] /= 300.0
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def tiny_config(tmp_path, model_dir, extra=""):
    docs = []
    for i in range(6):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(" ".join(f"Sentence {j} of document {i} talks about quantization and layers." for j in range(60)))
        docs.append(str(p))
    return write_yaml(tmp_path / "tiny.yaml", f"""
        name: tiny
        model: {{source: {{kind: local, path: {model_dir}}}}}
        text:
          source: {{kind: files, paths: {json.dumps(docs)}}}
          calibration: {{num_samples: 4, seq_len: 64}}
          evaluation: {{num_samples: 2, seq_len: 64}}
        sensitivity: {{formats: [int8_sq, int8_w8a8]}}
        plan:
          rules: [{{pattern: lm_head, keep_high_precision: true}}]
        build: {{max_batch_size: 4, max_input_len: 64, max_seq_len: 128, max_num_tokens: 256}}
        bench: {{concurrency: [1, 2]}}
        {extra}
        """)


def completion_order_with_classes(http_url: str, model: str, queue_size, at_least: float, hogs: int = 16,
                                  hog_tokens: int = 100, stagger: int = 0, queued: int = 0,
                                  queued_tokens: int = 100) -> list[str]:
    """Request classes on a real server published with triton.priority_levels 2: ``hogs`` long requests of the
    default level queue at the ensemble ``model`` (until ``queue_size()``, a gauge of the runtime's, reaches
    ``at_least``), then a request with no priority, one of level 2 and one of level 1 are sent in that order. The
    names of all of them in the order their answers came back.

    ``stagger``: long request i asks ``hog_tokens + stagger * i`` tokens, so that a batch of them started in one
    step ends one at a time (a batch that ends at once frees every slot in one step, and the requests already
    waiting take them all, whatever their level). ``queued``: once the long ones are in, as many requests
    "wait i" of ``queued_tokens``, sent and awaited (the gauge at ``at_least + queued``) before the three classes:
    they wait behind the long ones in the runtime's own queue.

    The queue forms only where the engine answers a long request more slowly than the ensemble hands the next
    one over: on a 2-core machine the ensemble's Python models hand over about 8 requests a second, and the
    tiny model answered 100 tokens in 0.13 s, so the queue never grew past 6 (seen in full runs). A long
    request needs ``hog_tokens`` of a few hundred."""
    import concurrent.futures
    import time
    import urllib.error
    import urllib.request

    done: dict[str, float] = {}
    tokens: dict[str, int] = {}

    def ask(name: str, max_tokens: int = 16, **extra) -> None:
        body = json.dumps({"text_input": f"Request {name}:", "max_tokens": max_tokens, **extra}).encode()
        req = urllib.request.Request(f"http://{http_url}/v2/models/{model}/generate", data=body, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                tokens[name] = len(json.loads(r.read())["output_ids"])
                assert tokens[name]
        except urllib.error.HTTPError as e:  # the server's own words, for a failure seen once under this burst
            raise AssertionError(f"{name!r}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from e
        done[name] = time.perf_counter()

    with concurrent.futures.ThreadPoolExecutor(hogs + queued + 3) as pool:
        t0 = time.perf_counter()
        futures: list = []

        def fill(prefix: str, n: int, max_tokens: int, step: int, depth: float) -> None:
            # end_id -1: a long request runs to its length (an end token would cut it short)
            futures.extend(pool.submit(ask, f"{prefix} {i}", max_tokens + step * i, end_id=-1) for i in range(n))
            deadline = time.monotonic() + 120
            seen: list[tuple[float, float, int]] = []  # (s since the first was sent, the gauge, answered)
            while time.monotonic() < deadline:
                seen.append((round(time.perf_counter() - t0, 2), queue_size(), len(done)))
                if seen[-1][1] >= depth:
                    return
                failed = next((f for f in futures if f.done() and f.exception()), None)
                if failed:
                    failed.result()  # a request failed: its name and the server's words, not a timeout
                time.sleep(0.1)
            answered = sorted((round(t - t0, 2), tokens[n]) for n, t in done.items())
            raise AssertionError(f"the {prefix!r} requests never queued {depth} deep in the runtime. The gauge "
                                 f"(s, value, answered): {seen[:40]}; the answers (s, tokens): {answered}")

        fill("long", hogs, hog_tokens, stagger, at_least)
        if queued:
            fill("wait", queued, queued_tokens, 0, at_least + queued)
        for name, priority in (("none", {}), ("level 2", {"priority": 2}), ("level 1", {"priority": 1})):
            futures.append(pool.submit(ask, name, **priority))
            time.sleep(0.2)  # sent in this order
        for f in futures:
            f.result()
    return sorted(done, key=done.get)


def metric(metrics_url: str, family: str, label: str, value: str) -> float:
    """One series of a Triton metrics endpoint, e.g. nv_trt_llm_request_metrics{request_type="active"}."""
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(family + "{") and f'{label}="{value}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{family}{{{label}={value}}} is not on the metrics endpoint")


@pytest.fixture(scope="session")
def tokens():
    """Calibration and evaluation token batches for the tiny Llama (seeded)."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 512, (4, 48), generator=g), torch.randint(3, 512, (2, 48), generator=g)


@pytest.fixture(scope="session")
def exported(tiny_model_dir, tokens, tmp_path_factory):
    """ModelOpt's exports of the tiny Llama, made once per session on first use (tests/modelopt_exports.py):
    case -> (plan, quant, checkpoint dir per tp, logits of ModelOpt's fake-quant model after the export)."""
    import torch
    from modelopt_exports import quantize_and_export
    from transformers import AutoModelForCausalLM

    calib, evals = tokens
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    cache: dict[str, dict] = {}

    def get(case: str) -> dict:
        if case not in cache:
            name = case.replace("+", "_")
            cache[case] = quantize_and_export(original, case, calib, evals,
                                              {tp: tmp_path_factory.mktemp(f"ckpt_{name}_tp{tp}") for tp in (1, 2)})
        return cache[case]

    return get
