"""What the invoke tasks call: load the config, run or explain stages, turn errors into one paragraph.

Kept free of invoke so it can be tested (and used) without a shell.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

from pipeline import artifacts, constants
from pipeline.config import LoadedConfig, load_config
from pipeline.errors import PipelineError
from pipeline.fsutil import remove_tree
from pipeline.runner import Runner, WorkDirLock
from pipeline.stages import STAGES, TASK_STAGES


@contextmanager
def user_errors() -> Iterator[None]:
    """Print a pipeline error as a paragraph (no traceback) and exit with its code."""
    try:
        yield
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except KeyboardInterrupt:
        print("interrupted.", file=sys.stderr)
        raise SystemExit(130) from None


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pipeline").setLevel(logging.INFO)
    # progress bars from the Hub client and transformers' loaders would flood CI logs
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    if not verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def open_runner(config: Optional[str], overrides: Sequence[str], work_root: Path) -> Runner:
    loaded: LoadedConfig = load_config(config or constants.DEFAULT_CONFIG, list(overrides))
    return Runner(loaded, STAGES, work_root)


def run_task(task: str, config: Optional[str], overrides: Sequence[str], work_root: Path,
             force: bool = False) -> list[dict]:
    runner = open_runner(config, overrides, work_root)
    print(f"config: {runner.loaded.name} ({runner.loaded.path}); work dir: {runner.work_dir}")
    targets = list(TASK_STAGES[task])
    return runner.run(targets, force=targets if force else False)


def run_all(config: Optional[str], overrides: Sequence[str], work_root: Path, force: bool = False) -> None:
    runner = open_runner(config, overrides, work_root)
    print(f"config: {runner.loaded.name} ({runner.loaded.path}); work dir: {runner.work_dir}")
    built = [s.name for s in STAGES if s.built]
    runner.run(built, force=force)
    missing = [s for s in STAGES if not s.built]
    if missing:
        print("not built yet (skipped): " + ", ".join(f"{s.name} (issue #{s.issue})" for s in missing))
    print(f"all: {len(built)} stage(s) ran or were up to date; artifacts in {runner.work_dir}")


def explain(config: Optional[str], overrides: Sequence[str], work_root: Path) -> bool:
    """Print which stages would run and why; True when everything built is up to date."""
    runner = open_runner(config, overrides, work_root)
    print(f"config: {runner.loaded.name} ({', '.join(str(p) for p in runner.loaded.files)})")
    print(f"work dir: {runner.work_dir}")
    all_current = True
    for st in runner.explain([s.name for s in STAGES]):
        built = runner.stages[st.name].built
        if st.up_to_date:
            print(f"  {st.name:<12} up to date")
        else:
            all_current = all_current and not built
            print(f"  {st.name:<12} " + ("will run: " if built else "") + "; ".join(st.reasons))
    return all_current


def clean(config: Optional[str], overrides: Sequence[str], work_root: Path) -> Path:
    runner = open_runner(config, overrides, work_root)
    with WorkDirLock(runner.work_dir):
        for child in runner.work_dir.iterdir():
            if child.name == artifacts.LOCK_FILE:
                continue
            if child.is_dir():
                remove_tree(child)
            else:
                child.unlink()
    (runner.work_dir / artifacts.LOCK_FILE).unlink(missing_ok=True)
    runner.work_dir.rmdir()
    return runner.work_dir
