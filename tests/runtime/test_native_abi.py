"""The native libraries' structs against their ctypes mirrors: the check before Python binds.

The built libraries report every mirrored struct's layout and it equals the mirrors'; a library
built from sources whose struct changed on the C side only (a field added, a field resized, the
ABI version moved) is refused with an error naming what differs, before any struct is passed.
"""

from __future__ import annotations

import ctypes
import shutil

import pytest

from polylane.runtime.model import block_weights
from polylane.runtime.model.native import abi, build, stack

STACK_STRUCTS = [stack.Matrix, stack.Layer, stack.Model, stack.Step]
BLOCK_STRUCTS = [block_weights.Segment, block_weights.BlockMatrix]


def _compiler() -> str:
    compiler = build._compiler()
    if compiler is None:
        pytest.skip("no C compiler here: the native libraries are not built")
    return compiler


def test_the_built_libraries_report_the_layout_their_mirrors_have():
    _compiler()
    decoder, blocks = stack.library(), block_weights.library()
    assert decoder is not None
    for lib, table, structures in (
        (decoder, "polylane_stack_abi", STACK_STRUCTS),
        (decoder, "polylane_blocks_abi", BLOCK_STRUCTS),
        (blocks, "polylane_blocks_abi", BLOCK_STRUCTS),
    ):
        reported = abi.reported_layout(lib, table)
        for structure in structures:
            assert reported[structure.__name__] == abi.mirrored_layout(structure)
            assert (
                len(reported[structure.__name__]) == len(structure._fields_) + 1
            )  # every field, and the size


CHANGES = {
    "a field added to Step": (
        "decoder.c",
        "    int threads;\n",
        "    int64_t added;\n    int threads;\n",
        r"Step\.threads is 4 bytes at offset 96 in C but 4 bytes at offset 88 in Python's mirror",
    ),
    "a field of BlockMatrix resized": (
        "blocks.c",
        "    int64_t activation_bits; /*",
        "    int32_t activation_bits; /*",
        r"BlockMatrix\.activation_bits is 4 bytes at offset 40 in C but 8 bytes",
    ),
    "another ABI version": (
        "blocks.c",
        "#define POLYLANE_ABI_VERSION 1\n",
        "#define POLYLANE_ABI_VERSION 2\n",
        r"native ABI version 2, this polylane 1",
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_library_built_with_a_changed_struct_is_refused(tmp_path, change):
    compiler = _compiler()
    source_name, old, new, message = CHANGES[change]
    for source in build.SOURCE_DIR.glob("*.c"):
        shutil.copy(source, tmp_path / source.name)
    changed = tmp_path / source_name
    text = changed.read_text()
    assert text.count(old) == 1, f"{source_name} no longer has {old!r} once"
    changed.write_text(text.replace(old, new))
    target = tmp_path / "decoder.so"
    build.build_library(tmp_path / "decoder.c", target, compiler, ("-O0",))  # the layout, not the speed
    with pytest.raises(abi.NativeAbiError, match=message):
        stack.check_abi(ctypes.CDLL(str(target)))
