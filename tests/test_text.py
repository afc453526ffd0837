"""Calibration/evaluation text: real prose, disjoint by document, deterministic given the seed."""

from __future__ import annotations

import json

import pytest
from safetensors.numpy import load_file

from pipeline import artifacts
from pipeline.config import FilesText, PydocTopicsText, TextSection, TokenSet
from pipeline.errors import InputError
from pipeline.source.text import load_documents, prepare_text


def _files(tmp_path, n=12, words=400):
    paths = []
    for i in range(n):
        p = tmp_path / f"doc{i:02d}.txt"
        p.write_text(" ".join(f"document {i} says word{j % 37} and more prose." for j in range(words // 6)))
        paths.append(p)
    return FilesText(kind="files", paths=tuple(paths))


def _section(source, seed=0, cal=(4, 64), ev=(2, 64)):
    return TextSection(source=source, seed=seed, calibration=TokenSet(num_samples=cal[0], seq_len=cal[1]),
                       evaluation=TokenSet(num_samples=ev[0], seq_len=ev[1]))


def _run(section, tok_dir, out):
    out.mkdir(parents=True)
    summary = prepare_text(section, tok_dir, out)
    ids = {k: load_file(str(out / f))[artifacts.TOKENS_KEY] for k, f in
           (("calibration", artifacts.CALIBRATION_TOKENS_FILE), ("evaluation", artifacts.EVALUATION_TOKENS_FILE))}
    return summary, ids


def test_pydoc_prose_has_no_code_blocks():
    docs = load_documents(PydocTopicsText(kind="pydoc_topics"))
    assert len(docs) > 50
    text = "\n".join(d.text for d in docs)
    assert ">>>" not in text and "\n    " not in text and "*****" not in text
    assert "The" in text and len(text) > 100_000


def test_sets_are_disjoint_shaped_and_deterministic(tmp_path, tiny_tokenizer_dir):
    section = _section(_files(tmp_path))
    s1, ids1 = _run(section, tiny_tokenizer_dir, tmp_path / "a")
    s2, ids2 = _run(section, tiny_tokenizer_dir, tmp_path / "b")
    assert ids1["calibration"].shape == (4, 64) and ids1["evaluation"].shape == (2, 64)
    assert not set(s1["calibration"]["documents"]) & set(s1["evaluation"]["documents"])
    for k in ids1:
        assert (ids1[k] == ids2[k]).all()
    assert (tmp_path / "a" / artifacts.CALIBRATION_TOKENS_FILE).read_bytes() == \
        (tmp_path / "b" / artifacts.CALIBRATION_TOKENS_FILE).read_bytes()
    rows = [json.loads(l) for l in (tmp_path / "a" / artifacts.EVALUATION_TEXT_FILE).read_text().splitlines()]
    assert len(rows) == 2 and "document" in rows[0]["text"]


def test_seed_changes_the_split_and_calibration_size_leaves_evaluation_alone(tmp_path, tiny_tokenizer_dir):
    src = _files(tmp_path)
    base, ids = _run(_section(src, seed=0), tiny_tokenizer_dir, tmp_path / "a")
    other, _ = _run(_section(src, seed=1), tiny_tokenizer_dir, tmp_path / "b")
    assert base["evaluation"]["documents"] != other["evaluation"]["documents"]
    bigger, ids_big = _run(_section(src, seed=0, cal=(8, 64)), tiny_tokenizer_dir, tmp_path / "c")
    assert (ids_big["evaluation"] == ids["evaluation"]).all()
    assert ids_big["calibration"].shape == (8, 64)


def test_not_enough_text_says_what_to_change(tmp_path, tiny_tokenizer_dir):
    with pytest.raises(InputError, match="Lower text"):
        _run(_section(_files(tmp_path, n=2), cal=(64, 256)), tiny_tokenizer_dir, tmp_path / "a")
