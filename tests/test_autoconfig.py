"""pipeline.autoconfig's reading of a model's type before any download: the GGUF header walk against gguf's own
reader, on the embedded default's file and on files gguf's writer makes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.autoconfig import gguf_architecture
from pipeline.config import load_config

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

gguf = pytest.importorskip("gguf")


def _written(path: Path, endian, *, architecture_last: bool) -> Path:
    """A GGUF file from gguf's writer: scalars, a string array (a vocabulary) and a float array, with
    ``general.architecture`` first (as the writer puts it) or after all of them."""
    w = gguf.GGUFWriter(str(path), "qwen2", endianess=endian)
    w.add_uint32("test.count", 7)
    w.add_bool("test.flag", True)
    w.add_token_list([f"tok{i}" for i in range(300)])
    w.add_array("test.floats", [0.5, 1.5, 2.5])
    w.add_string("general.name", "tiny")
    if architecture_last:  # the writer holds its keys in insertion order; move the architecture behind the rest
        kv = w.kv_data[0]
        kv["general.architecture"] = kv.pop("general.architecture")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
@pytest.mark.parametrize("architecture_last", [False, True])
def test_the_header_walk_reads_the_architecture_gguf_reads(tmp_path, endian, architecture_last):
    path = _written(tmp_path / "m.gguf", gguf.GGUFEndian[endian], architecture_last=architecture_last)
    field = gguf.GGUFReader(str(path)).fields["general.architecture"]
    assert gguf_architecture(path) == bytes(field.parts[field.data[0]]).decode() == "qwen2"


def test_the_default_models_file_and_a_config_load_read_it_from_the_header():
    from pipeline.config.loader import gguf_package_file

    loaded = load_config(Path(__file__).resolve().parent.parent / "engine_configs" / "smollm2-135m-cpu.yaml")
    path = gguf_package_file(loaded.config.model.source)
    field = gguf.GGUFReader(str(path)).fields["general.architecture"]
    assert gguf_architecture(path) == bytes(field.parts[field.data[0]]).decode() == "llama"
    assert loaded.resolution.model_type == "llama"


def test_a_file_that_is_not_gguf_or_ends_early_is_a_value_error(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="no GGUF magic"):
        gguf_architecture(tmp_path / "x.gguf")
    whole = _written(tmp_path / "m.gguf", gguf.GGUFEndian.LITTLE, architecture_last=True).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:200])
    with pytest.raises(ValueError, match="ends early"):
        gguf_architecture(tmp_path / "cut.gguf")
