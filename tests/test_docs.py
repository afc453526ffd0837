"""The documentation site (docs/, mkdocs.yml) holds to the code: it builds strict (every internal link and anchor
resolves), its configuration reference is the schema's, every typed error and every alert has its section, and
no page names a config field or an error class that does not exist."""

from __future__ import annotations

import builtins
import re
from pathlib import Path

import markdown
import pytest
from conftest import REPO

from pipeline import docs_reference, errors
from pipeline.config import AlertsSection, PipelineConfig
from pipeline.release import alerts

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

PAGES = sorted((REPO / "docs").rglob("*.md"))
# names in the docs that end like an error class but are upstream's, not this project's
# Triton's http_server.cc; OpenAI's error types (the openai client's exception names), which vLLM's server and the
# tenant middleware put in an error answer's "type"
UPSTREAM_NAMES = {"HttpCodeFromError", "BadRequestError", "RateLimitError"}
FILE_SUFFIXES = ("json", "yaml", "yml", "md", "py", "png", "html", "txt", "jsonl", "safetensors", "gguf", "log",
                 "pbtxt", "sh", "csv")


def anchors(page: Path) -> set[str]:
    """The ids of a page's headings, as MkDocs makes them (Markdown's toc, explicit {#id} included)."""
    md = markdown.Markdown(extensions=["toc", "attr_list", "tables"])
    md.convert(page.read_text(encoding="utf-8"))

    def walk(tokens) -> set[str]:
        return {t["id"] for t in tokens} | {i for t in tokens for i in walk(t["children"])}

    return walk(md.toc_tokens)  # type: ignore[attr-defined]


def test_the_configuration_reference_is_the_schemas():
    assert not docs_reference.stale(REPO), (
        f"{docs_reference.PAGE} differs from the config schema (pipeline.config): run `{docs_reference.FIX}`")


def test_every_config_field_has_a_description():
    assert docs_reference.undocumented() == [], (
        "these config fields have no description: add a comment beside the field in the schema (or an entry in "
        f"pipeline/docs_reference.py DESCRIPTIONS), then run `{docs_reference.FIX}`")


def test_the_site_builds_strict_with_every_link_and_anchor_resolving(tmp_path):
    out = docs_reference.build_site(REPO, tmp_path / "site")
    assert out.returncode == 0, f"`invoke docs` fails (a broken link or anchor, a page not in the nav):\n{out.stderr}"
    assert (tmp_path / "site" / "troubleshooting" / "index.html").is_file()


def _error_classes() -> list[type[errors.PipelineError]]:
    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.PipelineError)]


def test_every_typed_error_links_to_its_troubleshooting_section():
    page = REPO / errors.TROUBLESHOOTING_PAGE
    ids = anchors(page)
    assert len(_error_classes()) >= 8
    for cls in _error_classes():
        path, anchor = cls.docs_link().split("#")
        assert (REPO / path) == page
        assert anchor in ids, f"{cls.__name__}.docs_anchor {anchor!r} is no heading of {page.relative_to(REPO)}"
        # the class's own docs_anchor, not one inherited by accident
        assert "docs_anchor" in vars(cls), f"{cls.__name__} has no docs_anchor of its own"


def test_every_alert_has_a_runbook_section():
    ids = anchors(REPO / "docs" / "how-to" / "operate.md")
    names = {r["alert"] for engine in ("triton", "vllm") for r in alerts.rules(AlertsSection(), "x", engine=engine)}
    missing = sorted(n for n in names if n.lower() not in ids)
    assert missing == [], f"alerts without a section (### <AlertName>) in docs/how-to/operate.md: {missing}"


def unknown_config_paths(text: str) -> set[str]:
    """Dotted config paths (``quantization.kv_cache``) in ``text`` that the schema does not have."""
    sections = "|".join(PipelineConfig.model_fields)
    known = docs_reference.field_paths()
    found = re.findall(rf"(?<![\w./-])((?:{sections})(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?![\w/-])", text)
    bad = set()
    for path in found:
        parts = path.split(".")
        if parts[-1] in FILE_SUFFIXES or parts[0] == "model" and parts[1] in ("layers", "embed_tokens", "norm"):
            continue  # a file name (plan.yaml, model.safetensors.index.json) or a layer name (model.layers.3)
        if path not in known:
            bad.add(path)
    return bad


def unknown_error_classes(text: str) -> set[str]:
    """Names in ``text`` that look like this project's error classes and are not in pipeline.errors."""
    ours = {c.__name__ for c in _error_classes()}
    alert_names = {r["alert"] for e in ("triton", "vllm") for r in alerts.rules(AlertsSection(), "x", engine=e)}
    names = set(re.findall(r"\b[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)*(?:Error|Problem|Failed|Busy)\b", text))
    return {n for n in names if n not in ours and not hasattr(builtins, n) and n not in alert_names
            and n not in UPSTREAM_NAMES}


def test_no_page_names_a_config_field_or_an_error_that_does_not_exist():
    texts = {p.relative_to(REPO): p.read_text(encoding="utf-8") for p in [*PAGES, REPO / "README.md"]}
    fields = {str(p): sorted(unknown_config_paths(t)) for p, t in texts.items() if unknown_config_paths(t)}
    classes = {str(p): sorted(unknown_error_classes(t)) for p, t in texts.items() if unknown_error_classes(t)}
    assert fields == {}, f"pages name config fields the schema lacks (see {docs_reference.PAGE}): {fields}"
    assert classes == {}, f"pages name error classes pipeline/errors.py lacks: {classes}"


def test_a_removed_field_or_error_on_a_page_is_found():
    assert unknown_config_paths("set `quantization.kv_cache_format: fp8` or --set build.max_batch=4") == {
        "quantization.kv_cache_format", "build.max_batch"}
    assert unknown_config_paths("`quantization.kv_cache`, plan/plan.yaml, `plan.yaml`, model.layers.3.mlp, "
                                "pipeline.quant.plan, `text.source.repo_id`") == set()
    assert unknown_error_classes("a ConfigError, then a QuotaProblem and a KeyError") == {"QuotaProblem"}


def test_the_readme_links_only_to_pages_and_anchors_that_exist():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert links, "the README links into the docs"
    for path, anchor in links:
        page = REPO / path
        assert page.is_file() or path.endswith(".png"), f"README links to {path}, which does not exist"
        if anchor:
            assert anchor in anchors(page), f"README links to {path}#{anchor}: no such heading"
