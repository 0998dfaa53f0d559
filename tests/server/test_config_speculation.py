"""`speculation` and `dtype` in the serve config: forms they take, and a bad value named in the error."""

from __future__ import annotations

import pytest

from polylane.policy.speculation.control import SpeculationConfig
from polylane.policy.speculation.tree import TreeShape
from polylane.server.config import ConfigError, models_from_file


def _models(entries):
    return models_from_file({"models": entries}, "serve.toml")


def test_speculation_forms():
    models = _models(
        [
            {"name": "a"},
            {"name": "b", "speculation": True},
            {"name": "c", "speculation": ["ngram", "twin:int8"]},
            {"name": "d", "speculation": {"drafters": "a", "shape": "topk:2,1", "adaptive": False}},
        ]
    )
    assert [m.speculation for m in models[:2]] == [None, SpeculationConfig()]
    assert models[2].speculation.drafters == ("ngram", "twin:int8")
    assert models[3].speculation.shape == TreeShape.topk(2, 1) and not models[3].speculation.adaptive


@pytest.mark.parametrize(
    "value", [{"drafters": "twin:int2"}, {"mode": "sideways"}, {"colour": 1}, {"shape": "spiral:2"}, 3]
)
def test_bad_speculation_is_a_config_error(value):
    with pytest.raises(ConfigError, match=r"models\[0\]: speculation"):
        _models([{"name": "a", "speculation": value}])


def test_weight_dtypes_in_the_config():
    models = _models([{"name": "a", "dtype": "int4"}, {"name": "b", "dtype": "int8"}, {"name": "c"}])
    assert [m.dtype for m in models] == ["int4", "int8", "auto"]
    one_of = r"models\[0\]: dtype must be one of auto, auto-fp32, fp32, bf16, int8, int4"
    with pytest.raises(ConfigError, match=one_of):
        _models([{"name": "a", "dtype": "fp16"}])
