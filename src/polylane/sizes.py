"""Byte sizes as people write them: `6G`, `6GB`, `6GiB`, `6Gi`, `6000MB`, `1.5g`, plain bytes.

What this module owns: the one reading of a size used by every flag, config key and admin route
that takes one. Decimal units (k, M, G, T, with or without B) are powers of 1000 and binary units
(Ki, Mi, Gi, Ti, with or without B) powers of 1024, as Kubernetes reads them; case does not matter.
"""

from __future__ import annotations

import re

_PREFIXES = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
EXAMPLES = "examples: 4000000000, 6G, 6GiB, 6000MB"


def parse_bytes(value: str | int) -> int:
    """Bytes from an int >= 0 or a size string (see the module docstring); ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"cannot read size {value!r} ({EXAMPLES})")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size must be >= 0, got {value}")
        return value
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)", str(value).strip().lower())
    if not match or (match[3] and not match[2]):
        raise ValueError(f"cannot read size {value!r} ({EXAMPLES})")
    base = 1024 if match[3] else 1000
    return int(float(match[1]) * base ** _PREFIXES[match[2]])
