"""The stage graph: in pipeline order, named as the work dir's folders, each config input resolvable."""

from __future__ import annotations

from conftest import DEFAULT_CONFIG

from pipeline import artifacts
from pipeline.config import load_config
from pipeline.runner import Runner
from pipeline.stages import STAGES, TASK_STAGES


def test_stages_are_the_work_dir_folders_in_dependency_order():
    assert [s.name for s in STAGES] == list(artifacts.STAGE_TASK)
    seen: set[str] = set()
    for s in STAGES:
        assert set(s.needs) <= seen, f"{s.name} needs a later stage"
        seen.add(s.name)


def test_every_stage_is_run_by_exactly_one_task():
    listed = [stage for stages in TASK_STAGES.values() for stage in stages]
    assert sorted(listed) == sorted(artifacts.STAGE_TASK)


def test_every_stages_inputs_resolve_on_the_default_config(tmp_path):
    runner = Runner(load_config(DEFAULT_CONFIG), STAGES, tmp_path)
    for s in STAGES:
        if s.external_inputs is None:  # external fingerprints read the model source: covered by the e2e tests
            inputs = runner.compute_inputs(s)
            assert set(inputs["config"]) == set(s.sections)
            assert set(inputs["upstream"]) == set(s.needs)


def test_publish_runs_again_when_the_serving_model_code_changes(tmp_path, monkeypatch):
    """publish copies triton_repo/'s model code into the repository: that code is one of its inputs, so a
    repository published by older code is not kept as up to date."""
    import shutil

    from pipeline.serving import publish

    source = tmp_path / "triton_repo"
    shutil.copytree(publish.TRITON_SOURCE, source, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(publish, "TRITON_SOURCE", source)
    runner = Runner(load_config(DEFAULT_CONFIG), STAGES, tmp_path / "work")
    stage = next(s for s in STAGES if s.name == "publish")
    before = runner.compute_inputs(stage)
    assert before == runner.compute_inputs(stage)
    model = source / "tensorrt_llm_vllm" / "model.py"
    model.write_text(model.read_text() + "\n# changed\n")
    after = runner.compute_inputs(stage)
    assert after["external"]["model_code_sha256"] != before["external"]["model_code_sha256"]


def test_publish_runs_again_when_the_tenants_change(tmp_path):
    """The tenants go into the engine model's parameters and the models' inputs: a changed tenants section is a
    new repository, not the cached one."""
    stage = next(s for s in STAGES if s.name == "publish")
    inputs = [Runner(load_config(DEFAULT_CONFIG, sets), STAGES, tmp_path / "work").compute_inputs(stage)["config"]
              for sets in ([], ["tenants=[{name: a, kv_share: 0.5}]"], ["tenants=[{name: a, kv_share: 0.25}]"])]
    assert inputs[0] != inputs[1] != inputs[2]


def test_the_sensitivity_measurement_reads_every_sensitivity_field_but_the_threshold(tmp_path):
    """A threshold sweep shares one measurement: sensitivity.threshold is the plan's input, not the sensitivity
    stage's, while every other field of the section (a new one included) is the measurement's."""
    from pipeline.config import SensitivitySection
    from pipeline.stages import SENSITIVITY_MEASURED_FIELDS

    assert set(SENSITIVITY_MEASURED_FIELDS) == {f"sensitivity.{f}" for f in SensitivitySection.model_fields} - \
        {"sensitivity.threshold"}
    sens, plan = (next(s for s in STAGES if s.name == name) for name in ("sensitivity", "plan"))
    runs = [Runner(load_config(DEFAULT_CONFIG, sets), STAGES, tmp_path) for sets in ([], ["sensitivity.threshold=0.2"])]
    assert runs[0].compute_inputs(sens) == runs[1].compute_inputs(sens)
    assert runs[0].compute_inputs(plan)["config"] != runs[1].compute_inputs(plan)["config"]
