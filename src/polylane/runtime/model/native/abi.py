"""The native libraries' binary interface, checked before Python binds to them.

What this module owns: reading the layout a compiled library reports of every C struct that
Python mirrors with ctypes (`polylane_abi_version`, and per struct its size and each field's offset
and size: `polylane_blocks_abi` in blocks.c, `polylane_stack_abi` in decoder.c) and comparing it
with the ctypes mirrors. A mismatch — a field added, moved or resized on one side only, or another
ABI version — raises NativeAbiError naming the struct and field: passing a struct of the wrong
layout to C would corrupt memory silently.
"""

from __future__ import annotations

import ctypes

# The version of the structs' layout this Python code speaks (blocks.c POLYLANE_ABI_VERSION): both
# change together whenever a mirrored struct changes.
ABI_VERSION = 1


REFUSED = "refusing to bind (a struct changed on one side only)"


class NativeAbiError(RuntimeError):
    """A native library whose structs do not match the Python mirrors (refused, never bound)."""


class AbiField(ctypes.Structure):
    _fields_ = [
        ("structure", ctypes.c_char_p),
        ("field", ctypes.c_char_p),  # "" for the struct's own size
        ("offset", ctypes.c_int64),
        ("size", ctypes.c_int64),
    ]


def reported_layout(lib: ctypes.CDLL, table: str) -> dict[str, dict[str, tuple[int, int]]]:
    """{struct: {field: (offset, size)}} as the library's `table` function reports it ("" the size)."""
    function = getattr(lib, table)
    function.argtypes = [ctypes.POINTER(ctypes.POINTER(AbiField))]
    function.restype = ctypes.c_int64
    entries = ctypes.POINTER(AbiField)()
    count = function(ctypes.byref(entries))
    layout: dict[str, dict[str, tuple[int, int]]] = {}
    for i in range(count):
        entry = entries[i]
        layout.setdefault(entry.structure.decode(), {})[entry.field.decode()] = (entry.offset, entry.size)
    return layout


def mirrored_layout(structure: type[ctypes.Structure]) -> dict[str, tuple[int, int]]:
    """The ctypes mirror's {field: (offset, size)}, "" its size."""
    fields = {
        name: (getattr(structure, name).offset, getattr(structure, name).size)
        for name, *_ in structure._fields_
    }
    return {"": (0, ctypes.sizeof(structure)), **fields}


def check(lib: ctypes.CDLL, library_name: str, table: str, structures: list[type[ctypes.Structure]]) -> None:
    """Raise NativeAbiError unless `lib` speaks ABI_VERSION and its `table` reports exactly the
    layout of each ctypes mirror in `structures` (every field, offset and size, and the size)."""
    version = lib.polylane_abi_version
    version.restype = ctypes.c_int64
    if version() != ABI_VERSION:
        raise NativeAbiError(
            f"the {library_name} library speaks native ABI version {version()}, this polylane {ABI_VERSION}: "
            "it was built from other sources; remove it from the kernel cache to rebuild it"
        )
    reported = reported_layout(lib, table)
    for structure in structures:
        name = structure.__name__
        theirs, ours = reported.get(name), mirrored_layout(structure)
        if theirs is None:
            raise NativeAbiError(f"the {library_name} library reports no struct {name}")
        for field in [*ours, *(field for field in theirs if field not in ours)]:  # the mirror's, then C's own
            if field and theirs.get(field) != ours.get(field):
                raise NativeAbiError(
                    f"the {library_name} library's {name}.{field} is {_describe(theirs.get(field))} in C but "
                    f"{_describe(ours.get(field))} in Python's mirror: {REFUSED}"
                )
        if theirs[""] != ours[""]:
            raise NativeAbiError(
                f"the {library_name} library's {name} is {theirs[''][1]} bytes in C but {ours[''][1]} in "
                f"Python's mirror: {REFUSED}"
            )


def _describe(place: tuple[int, int] | None) -> str:
    return "missing" if place is None else f"{place[1]} bytes at offset {place[0]}"
