"""The formats table is the one vocabulary: the config schema, the plan and the checkpoint reader agree with it."""

from typing import get_args

import pytest

from pipeline import formats
from pipeline.config import KVCacheFormat, SensitivityFormat, WeightFormat
from pipeline.quant import checkpoint

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start


def test_config_literals_are_the_tables_names():
    assert set(get_args(WeightFormat)) == set(formats.FORMATS) | {formats.NO_QUANT}
    assert set(get_args(KVCacheFormat)) == set(formats.KV_CACHE_ALGOS)
    assert set(get_args(SensitivityFormat)) == set(formats.SENSITIVITY_COLUMNS)


def test_every_format_has_a_measured_column_and_a_readable_algo():
    for f in formats.FORMATS.values():
        assert f.sensitivity_column in formats.SENSITIVITY_COLUMNS, f.name
        assert f.trtllm_quant_algo in checkpoint.READABLE_ALGOS, f.name
        assert f.checkpoint_scales and f.checkpoint_scales[0] == "weights_scaling_factor", f.name


@pytest.mark.parametrize("fmt,expected", [
    ("int8_wo", 64 * 32 + 4 * 64),
    ("int8_sq", 64 * 32 + 4 * 64 + 4 * 32),
    ("fp8", 64 * 32 + 4),
    ("int4_awq", 64 * 32 // 2 + 2 * (64 * 32 // 16) + 2 * 32),
    ("high_precision", 2 * 64 * 32),
])
def test_weight_bytes(fmt, expected):
    assert formats.weight_bytes(fmt, 64, 32, 16) == expected


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown format"):
        formats.weight_bytes("nvfp4", 64, 32, 16)
