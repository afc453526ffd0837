"""Upstream's facts (tests/data/upstream/*.json, each citing its repository, commit and paths) as test helpers:
the JSON readers and trtllm-build's argument parser rebuilt from upstream's flag table. Used by
tests/engines/trtllm/test_upstream_contract.py and by the stand-in tests/bin/trtllm-build-recorder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

UPSTREAM = Path(__file__).parent / "data" / "upstream"


def upstream(name: str) -> dict:
    return json.loads((UPSTREAM / name).read_text())


def trtllm_build_parser() -> argparse.ArgumentParser:
    """trtllm-build's argument parser as trtllm_build_flags.json records it (build.py + plugin.py's
    add_plugin_argument): its flags, aliases, types and choices; an unknown flag or value is an error."""
    facts = upstream("trtllm_build_flags.json")
    p = argparse.ArgumentParser(prog="trtllm-build", add_help=False, allow_abbrev=False, exit_on_error=False)
    for flag in facts["flags"] + facts["plugin_flags"]:
        names = [flag["name"], *flag.get("aliases", [])]
        kind, choices = flag["type"], flag.get("choices")
        if kind == "flag":
            p.add_argument(*names, action="store_true")
        elif "nargs='+'" in kind:
            p.add_argument(*names, nargs="+", choices=choices)
        elif kind == "int":
            p.add_argument(*names, type=int)
        else:
            p.add_argument(*names, type=str, choices=choices)  # choices None: any string (e.g. --log_level)
    return p


def parse_trtllm_build_argv(args: list[str]) -> tuple[dict, list[str]]:
    """(parsed values, problems) as upstream's trtllm-build would see ``args``."""
    try:
        ns, extra = trtllm_build_parser().parse_known_args(args)
    except argparse.ArgumentError as e:
        return {}, [str(e)]
    return vars(ns), ([f"unrecognized arguments: {extra}"] if extra else [])
