"""Calibration/evaluation text: real prose, disjoint by document, deterministic given the seed."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEFAULT_CONFIG, REPO, write_yaml
from safetensors.numpy import load_file

from pipeline import artifacts
from pipeline.config import DatasetText, FilesText, PydocTopicsText, TextSection, TokenSet, load_config
from pipeline.errors import ConfigError, InputError
from pipeline.fsutil import HashCache
from pipeline.source.text import load_documents, prepare_text, text_fingerprint

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start


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


# ---------------------------------------------------------------- dataset sources (Hugging Face datasets)

CNN_REVISION = "96df5e686bee6baa90b8bee7c28b81fa3fa6223d"


def _articles(n=30, sentences=12):
    return [{"id": f"a{i:03d}", "article": " ".join(f"Story {i} reports fact {j} about the harbour." for j in
                                                     range(sentences))} for i in range(n)]


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dataset(files, fmt, **kw):
    return DatasetText(kind="dataset", files=tuple(files), format=fmt, **{"text_field": "article", **kw})


def _chat_tokenizer(tok_dir, tmp_path):
    """The tiny tokenizer with a chat template whose markers ("<s>", "[role]") plain text never tokenizes to."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.chat_template = "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    out = tmp_path / "chat_tokenizer"
    tok.save_pretrained(out)
    return out, tok.bos_token_id


def test_dataset_rows_give_the_seeded_disjoint_sets_of_their_text(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    rows = _articles()
    src = _dataset([_parquet(tmp_path / "news.parquet", rows)], "parquet")
    s1, ids1 = _run(_section(src), tiny_tokenizer_dir, tmp_path / "a")
    s2, ids2 = _run(_section(src), tiny_tokenizer_dir, tmp_path / "b")
    other, ids_other = _run(_section(src, seed=1), tiny_tokenizer_dir, tmp_path / "c")
    assert ids1["calibration"].shape == (4, 64) and ids1["evaluation"].shape == (2, 64)
    assert s1["source_documents"] == 30
    assert not set(s1["calibration"]["documents"]) & set(s1["evaluation"]["documents"])
    for k in ids1:
        assert (ids1[k] == ids2[k]).all()
        assert s1[k]["documents"] == s2[k]["documents"]
    assert other["evaluation"]["documents"] != s1["evaluation"]["documents"]
    assert not (ids_other["evaluation"] == ids1["evaluation"]).all()
    # the evaluation rows are the listed rows' text, tokenized and packed with an EOS after each
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    stream = []
    for doc_id in s1["evaluation"]["documents"]:
        index = int(doc_id.removeprefix("train[").removesuffix("]"))
        stream += tok(rows[index]["article"], add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert ids1["evaluation"].reshape(-1).tolist() == stream[:128]


def test_jsonl_files_read_in_order_match_one_parquet_of_the_same_rows(tmp_path, tiny_tokenizer_dir):
    rows = _articles()
    parts = [_jsonl(tmp_path / "a.jsonl", rows[:13]), _jsonl(tmp_path / "b.jsonl", rows[13:])]
    from_jsonl, ids_jsonl = _run(_section(_dataset(parts, "jsonl")), tiny_tokenizer_dir, tmp_path / "j")
    whole = _dataset([_parquet(tmp_path / "all.parquet", rows)], "parquet")
    from_parquet, ids_parquet = _run(_section(whole), tiny_tokenizer_dir, tmp_path / "p")
    assert from_jsonl["calibration"]["documents"] == from_parquet["calibration"]["documents"]
    for k in ids_jsonl:
        assert (ids_jsonl[k] == ids_parquet[k]).all()


def test_fingerprint_is_the_local_files_bytes_and_the_hub_commit(tmp_path):
    data = _parquet(tmp_path / "data" / "news.parquet", _articles())
    cfg = write_yaml(tmp_path / "cfg.yaml", f"""
        extends: {DEFAULT_CONFIG}
        text:
          source: {{kind: dataset, files: [data/news.parquet], format: parquet, text_field: article}}
        """)
    loaded = load_config(cfg)
    assert loaded.config.text.source.files == (data,)  # relative to the config file
    cache = HashCache(None)
    before = text_fingerprint(loaded, cache)
    assert before == {"kind": "dataset", "files": {str(data): hashlib.sha256(data.read_bytes()).hexdigest()}}
    _parquet(data, _articles(n=31))
    assert text_fingerprint(loaded, cache) != before
    hub = write_yaml(tmp_path / "hub.yaml", f"""
        extends: {DEFAULT_CONFIG}
        text:
          source: {{kind: dataset, repo_id: abisee/cnn_dailymail, revision: {CNN_REVISION}, name: 3.0.0,
                   split: train, text_field: article}}
        """)
    assert text_fingerprint(load_config(hub), cache) == {
        "kind": "dataset", "repo_id": "abisee/cnn_dailymail", "revision": CNN_REVISION}


def test_chat_true_renders_messages_and_strings_with_the_chat_template(tmp_path, tiny_tokenizer_dir):
    tok_dir, bos = _chat_tokenizer(tiny_tokenizer_dir, tmp_path)
    chats = [{"messages": [{"role": "user", "content": r["article"]},
                           {"role": "assistant", "content": f"Summary {i}."}]}
             for i, r in enumerate(_articles(sentences=2))]  # short: whole conversations fit in a row of 64
    messages = _jsonl(tmp_path / "chats.jsonl", chats)
    summary, ids = _run(_section(_dataset([messages], "jsonl", text_field="messages", chat=True)), tok_dir,
                        tmp_path / "m")
    assert (ids["calibration"] == bos).any() and (ids["evaluation"] == bos).any()
    text = (tmp_path / "m" / artifacts.CALIBRATION_TEXT_FILE).read_text()
    assert "[user] Story" in text and "[assistant] Summary" in text

    strings = _dataset([_jsonl(tmp_path / "news.jsonl", _articles())], "jsonl", chat=True)
    _, ids = _run(_section(strings), tok_dir, tmp_path / "s")
    assert (ids["calibration"] == bos).any()
    assert "[user] Story" in (tmp_path / "s" / artifacts.EVALUATION_TEXT_FILE).read_text()
    _, plain = _run(_section(_dataset([tmp_path / "news.jsonl"], "jsonl")), tok_dir, tmp_path / "p")
    assert not (plain["calibration"] == bos).any()  # without chat: the text as it is

    with pytest.raises(InputError, match="list of chat messages: set text.source.chat: true"):
        _run(_section(_dataset([messages], "jsonl", text_field="messages")), tok_dir, tmp_path / "x")
    with pytest.raises(InputError, match="tokenizer has no chat template"):
        _run(_section(strings), tiny_tokenizer_dir, tmp_path / "y")


@pytest.mark.parametrize("case, expected", [
    ({"text_field": "body"},
     r"split 'train', has no field 'body'; its fields: id, article\. Set text.source.text_field"),
    ({"split": "validation"}, r"has no split 'validation'; its splits: train\. Set text.source.split"),
    ({"text_field": "n"}, r"row \d+ of split 'train' holds int \(\d+\), not text"),
    ({"fmt": "jsonl"}, r"text.source.files \(jsonl\): cannot read them as jsonl"),
], ids=["field", "split", "not-text", "format"])
def test_bad_dataset_input_names_what_exists(tmp_path, tiny_tokenizer_dir, case, expected):
    rows = [{**r, "n": i} if case.get("text_field") == "n" else r for i, r in enumerate(_articles())]
    src = _dataset([_parquet(tmp_path / "news.parquet", rows)], **{"fmt": "parquet", **case})
    with pytest.raises(InputError, match=expected):
        _run(_section(src), tiny_tokenizer_dir, tmp_path / "a")


def test_too_few_tokens_says_how_many_exist_and_were_asked(tmp_path, tiny_tokenizer_dir):
    src = _dataset([_parquet(tmp_path / "news.parquet", _articles(n=3))], "parquet")
    with pytest.raises(InputError) as e:
        _run(_section(src, cal=(64, 256)), tiny_tokenizer_dir, tmp_path / "a")
    msg = str(e.value)
    assert "text source has 3 documents, " in msg and "tokens in all" in msg
    assert "evaluation asks for 2x64 = 128 and calibration for 64x256 = 16384 tokens" in msg
    assert "Lower text.*.num_samples / seq_len" in msg


@pytest.mark.parametrize("source, expected", [
    ("{kind: dataset, repo_id: abisee/cnn_dailymail, revision: main, text_field: article}",
     "text.source.revision = 'main': must be a 40-character commit sha"),
    ("{kind: dataset, repo_id: abisee/cnn_dailymail, text_field: article}",
     "repo_id abisee/cnn_dailymail needs revision"),
    (f"{{kind: dataset, repo_id: abisee/cnn_dailymail, revision: {CNN_REVISION}, files: [a.parquet], "
     f"format: parquet, text_field: article}}", "not both"),
    ("{kind: dataset, files: [nowhere.parquet], format: parquet, text_field: article}",
     "text.source.files: no such file\\(s\\): .*nowhere.parquet"),
    ("{kind: dataset, files: [nowhere.parquet], text_field: article}", "files need format"),
], ids=["branch", "no-revision", "both", "missing-file", "no-format"])
def test_dataset_source_config_is_refused_when_unpinned_or_missing(tmp_path, source, expected):
    cfg = write_yaml(tmp_path / "cfg.yaml", f"extends: {DEFAULT_CONFIG}\ntext:\n  source: {source}\n")
    with pytest.raises(ConfigError, match=expected):
        load_config(cfg)


def _cache_as_hub_commit(rows, datasets_cache, commit):
    """Put rows in the datasets cache where a download of abisee/cnn_dailymail 3.0.0 at ``commit`` lands
    (<cache>/abisee___cnn_dailymail/3.0.0/0.0.0/<commit>/), as datasets itself writes a split there."""
    import datasets

    parquet = _parquet(datasets_cache.parent / "rows.parquet", rows)
    built = datasets.load_dataset("parquet", data_files={"train": str(parquet)},
                                  cache_dir=str(datasets_cache.parent / "build"))
    written = Path(built["train"].cache_files[0]["filename"]).parent
    entry = datasets_cache / "abisee___cnn_dailymail" / "3.0.0" / "0.0.0" / commit
    entry.mkdir(parents=True)
    (entry / "cnn_dailymail-train.arrow").write_bytes((written / "parquet-train.arrow").read_bytes())
    info = json.loads((written / "dataset_info.json").read_text())
    (entry / "dataset_info.json").write_text(json.dumps({**info, "dataset_name": "cnn_dailymail",
                                                         "config_name": "3.0.0"}))


def test_offline_hub_dataset_is_read_only_at_its_pinned_commit(tmp_path):
    """A fresh process, as a task is (``datasets`` reads HF_HUB_OFFLINE when imported). Offline, ``datasets``
    falls back to the newest cached copy of any commit: only the pinned one may be used."""
    other = "1" * 40
    _cache_as_hub_commit(_articles(n=5), tmp_path / "hf" / "datasets", other)
    script = (
        "from pipeline.config import DatasetText\n"
        "from pipeline.errors import InputError\n"
        "from pipeline.source.text import load_documents\n"
        f"for rev in ('{CNN_REVISION}', '{other}'):\n"
        "    src = DatasetText(kind='dataset', repo_id='abisee/cnn_dailymail', revision=rev, name='3.0.0',\n"
        "                      text_field='article')\n"
        "    try:\n        docs = load_documents(src)\n        print('rows:', len(docs), docs[4].text[:15])\n"
        "    except InputError as e:\n        print('InputError:', e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "hf_secret_never_shown"}
    env.pop("HF_DATASETS_OFFLINE", None)
    env.pop("HF_DATASETS_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    pinned, cached = proc.stdout.splitlines()
    assert pinned == (f"InputError: Hub dataset abisee/cnn_dailymail@{CNN_REVISION} (config 3.0.0): the datasets "
                      f"cache holds commit(s) {other}, not the pinned one. Load it once with network access "
                      "(HF_HUB_OFFLINE unset).")
    assert cached == "rows: 5 Story 4 reports"
    assert "hf_secret_never_shown" not in proc.stdout + proc.stderr

    empty = {**env, "HF_HOME": str(tmp_path / "empty")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=empty, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == (
        f"InputError: Hub dataset abisee/cnn_dailymail@{CNN_REVISION} (config 3.0.0) is not in the local datasets "
        "cache and HF_HUB_OFFLINE is set. Load it once with network access, or unset HF_HUB_OFFLINE.")
