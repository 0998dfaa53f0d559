"""Sibling models declared in the serve config: parsed into a source folder and a spec, refused
when incomplete, and written only when missing (no model is loaded here)."""

from __future__ import annotations

import json

import pytest

from polylane.runtime.residency.siblings import SIBLING_RECORD, SiblingSpec, sibling_path
from polylane.server.config import ConfigError, ensure_siblings, models_from_file


def test_sibling_declaration_parses_to_a_cached_folder() -> None:
    data = {
        "models": [
            {"name": "smol", "source": "smollm2-135m-instruct"},
            {"name": "smol-top", "sibling_of": "smollm2-135m-instruct", "top_layers": 15, "seed": 3},
        ]
    }
    plain, sibling = models_from_file(data, "x.toml")
    assert plain.sibling is None and plain.sibling_of is None
    assert sibling.sibling_of == "smollm2-135m-instruct"
    assert sibling.sibling == SiblingSpec(top_layers=15, seed=3)
    assert sibling.source == str(sibling_path("smollm2-135m-instruct", SiblingSpec(top_layers=15, seed=3)))
    other = models_from_file(
        {"models": [{"name": "b", "sibling_of": "smollm2-135m-instruct", "top_layers": 15, "seed": 4}]}, "x"
    )[0]
    assert other.source != sibling.source, "another spec must get another folder"


def test_sibling_with_explicit_source_and_finetune(tmp_path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("some text to learn")
    entry = {
        "name": "tuned",
        "sibling_of": "smollm2-135m-instruct",
        "top_layers": 2,
        "finetune": str(text),
        "steps": 3,
        "source": str(tmp_path / "out"),
    }
    [model] = models_from_file({"models": [entry]}, "x.toml")
    assert model.source == str(tmp_path / "out")
    assert model.sibling == SiblingSpec(top_layers=2, finetune_text=str(text), steps=3)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"sibling_of": "m"}, "top_layers an integer"),
        ({"sibling_of": "m", "top_layers": 0}, "top_layers must be >= 1"),
        ({"top_layers": 3}, "only apply with sibling_of"),
        ({"seed": 3}, "only apply with sibling_of"),
        ({"sibling_of": "m", "top_layers": 3, "seed": 1, "finetune": "t.txt"}, "not both"),
        ({"sibling_of": "m", "top_layers": 3, "finetune": "/no/such/file.txt"}, "fine-tuning text"),
        ({"sibling_of": "m", "top_layers": 3, "scale": -1.0}, "must be > 0"),
        ({"sibling_of": "m", "top_layers": 3, "colour": "red"}, "unknown keys"),
    ],
)
def test_bad_sibling_declarations_are_config_errors(entry, message) -> None:
    with pytest.raises(ConfigError, match=message):
        models_from_file({"models": [{"name": "s", **entry}]}, "x.toml")


def test_ensure_siblings_leaves_an_existing_sibling_alone(tmp_path) -> None:
    folder = tmp_path / "made-before"
    folder.mkdir()
    (folder / SIBLING_RECORD).write_text(json.dumps({"source": "m"}))
    entry = {"name": "s", "sibling_of": "no-such-model", "top_layers": 1, "source": str(folder)}
    ensure_siblings(models_from_file({"models": [entry]}, "x.toml"), quiet=True)  # nothing to write
    assert sorted(p.name for p in folder.iterdir()) == [SIBLING_RECORD]
    entry["source"] = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="cannot write its sibling"):
        ensure_siblings(models_from_file({"models": [entry]}, "x.toml"), quiet=True)
