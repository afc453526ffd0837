"""commands: what each task calls, without a shell (and the tasks themselves, through invoke)."""

from __future__ import annotations

import pytest
from conftest import DEFAULT_CONFIG, run_invoke, write_yaml

from pipeline import artifacts, commands
from pipeline.errors import ConfigError

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start


def test_user_errors_print_one_paragraph_and_exit_with_the_errors_code(capsys):
    with pytest.raises(SystemExit) as e, commands.user_errors():
        raise ConfigError("build.max_batch_size: 0 is not allowed; use 1 or more")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: build.max_batch_size") and "Traceback" not in err
    assert err.rstrip().endswith("(causes and fixes: docs/troubleshooting.md#configerror)")  # a heading there


def test_explain_on_a_fresh_work_dir_lists_every_stage(tmp_path, capsys):
    assert commands.explain(None, [], tmp_path) is False
    out = capsys.readouterr().out
    for stage in artifacts.STAGE_TASK:
        assert f"  {stage:<12} will run: never run (no manifest)" in out
    assert not (tmp_path / commands.default_config().stem / artifacts.LOCK_FILE).exists()


def test_print_summary_without_a_report_says_how_to_make_one(tmp_path, capsys):
    commands.print_summary(None, [], tmp_path)
    assert capsys.readouterr().out.strip() == "report: not run (`invoke report` writes it)"


def test_clean_removes_the_work_dir(tmp_path):
    work = tmp_path / commands.default_config().stem  # no --config: the project's default (here)
    (work / "model").mkdir(parents=True)
    (work / "model" / "x.bin").write_bytes(b"x")
    assert commands.clean(None, [], tmp_path) == work
    assert not work.exists()


def test_image_without_a_published_build_names_the_task_to_run(tmp_path):
    with pytest.raises(Exception, match="invoke publish"):
        commands.image(None, [], work_root=tmp_path, dry_run=True)


def test_explain_task_and_its_old_name(tmp_path):
    r = run_invoke("explain", "--work-root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "quantize     will run" in r.stdout
    old = run_invoke("plan", "--work-root", str(tmp_path))
    assert old.returncode == 0 and old.stdout == r.stdout
    assert "now `invoke explain`" in old.stderr


def test_a_bad_config_exits_2_without_a_traceback(tmp_path):
    bad = write_yaml(tmp_path / "bad.yaml", f"extends: {DEFAULT_CONFIG}\nbuild: {{max_batch_sise: 4}}\n")
    r = run_invoke("explain", "--config", str(bad), "--work-root", str(tmp_path))
    assert r.returncode == 2
    assert "max_batch_sise" in r.stderr and "Traceback" not in r.stderr
