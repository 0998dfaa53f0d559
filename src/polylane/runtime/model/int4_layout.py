"""Reading torch's CPU int4 packing back: which nibble of the packed weight holds which code.

What this module owns: finding out, by packing probes once per process, how
`aten._convert_weight_to_int4pack_for_cpu` lays out an (N, K) matrix of 4-bit codes, and unpacking
rows of a packed weight with that layout. It does not quantise or multiply (`runtime.model.quantize`).

torch's packing is private and differs by the CPU capability its kernels were dispatched for
(`torch.backends.cpu.get_cpu_capability()`, overridable with ATEN_CPU_CAPABILITY). Measured on
torch 2.13.0, every layout stores blocks of B output rows one after another; within a block, for
each input column k in turn, B nibbles (B / 2 bytes, low nibble first) hold the block's rows in a
fixed order:

- AVX512: B = 64; byte j of a column holds row j (low nibble) and row j + 32 (high).
- AVX2: B = 32; byte j holds row j and row j + 16.
- DEFAULT (no vector unit): B = 32; byte j holds row 2j and row 2j + 1.

Nothing here assumes one of these: `packing_layout` derives B and the row order by packing
probes whose codes spell out each element's own index (four bits per probe) and reading where
every code landed, then checks that the whole probe fits "blocks of B rows, column-major within a
block". A packing that does not fit (a future torch) yields None, and callers take a slower path
that asks torch's kernel for the codes instead of reading its bytes. Unpacking a known interleave
is a view and a permute, any other row order a gather of whole rows (`python bench/int4_unpack.py`
on the 2-core EPYC, AVX512 layout: 0.85 / 0.93 ms for a 3,072 × 576 weight, 19.9 / 22.3 ms for
17,920 × 1,536).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# The probe's shape: 128 rows (two blocks of 64, four of 32) and 64 columns; a layout must hold
# for every N that is a multiple of its block and every even K (checked in tests over several).
PROBE_ROWS, PROBE_COLUMNS = 128, 64


@dataclass(frozen=True)
class Int4Layout:
    """Blocks of `block_rows` output rows; within a block, column k's nibbles are at positions
    k · block_rows + j (nibble 2i + 1 is byte i's high nibble), and position j holds the block's row
    `row_at[j]`."""

    capability: str
    block_rows: int
    row_at: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.capability} ({self.block_rows}-row blocks)"

    def unpack(self, packed: torch.Tensor, in_features: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) (multiples of `block_rows`) of the codes (N, K) in [0, 15], uint8."""
        if start % self.block_rows or stop % self.block_rows:
            raise ValueError(f"int4 rows [{start}, {stop}) are not whole {self.block_rows}-row blocks")
        flat = packed.reshape(-1)[start * in_features // 2 : stop * in_features // 2]
        nibbles = torch.stack([flat & 0xF, flat >> 4], dim=-1).reshape(-1)  # in position order
        return self.arrange(nibbles, stop - start, in_features)

    def arrange(self, by_position: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        """(rows, columns) from values listed in packing order (one per nibble position)."""
        block = self.block_rows
        grid = by_position.view(rows // block, columns, block)  # [block, column, position]
        if self.interleave:  # position i·b + j holds row j·(block / b) + i: a transpose, no gather
            b = self.interleave
            grid = grid.view(rows // block, columns, block // b, b)  # [block, column, i, j]
            return grid.permute(0, 3, 2, 1).reshape(rows, columns)
        order = torch.tensor(self.position_of, dtype=torch.int64)
        rows_first = grid.transpose(1, 2).contiguous()  # [block, position, column]
        return rows_first.index_select(1, order).reshape(rows, columns)

    @functools.cached_property
    def interleave(self) -> int | None:
        """b where position i·b + j holds row j·(block_rows / b) + i (b = 2: AVX512's and AVX2's
        low and high nibbles; b = 1: rows in order, DEFAULT's); None for another order."""
        block = self.block_rows
        for b in (1, 2, 4, 8):
            if block % b == 0 and self.row_at == tuple((p % b) * (block // b) + p // b for p in range(block)):
                return b
        return None

    @property
    def position_of(self) -> tuple[int, ...]:
        """position_of[r]: where row r of a block sits within a column (the inverse of `row_at`)."""
        positions = [0] * self.block_rows
        for position, row in enumerate(self.row_at):
            positions[row] = position
        return tuple(positions)


@functools.cache
def packing_layout() -> Int4Layout | None:
    """The layout this process's torch packs int4 weights in, or None if it is not of the "blocks
    of rows, column-major within a block" kind (see the module doc)."""
    rows, columns = PROBE_ROWS, PROBE_COLUMNS
    index = torch.arange(rows * columns, dtype=torch.int64).view(rows, columns)
    stored = torch.zeros(rows * columns, dtype=torch.int64)  # stored[position]: the index found there
    for shift in range(0, int(index.max()).bit_length(), 4):
        codes = ((index >> shift) & 0xF).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).reshape(-1)
        if packed.dtype != torch.uint8 or packed.numel() * 2 != rows * columns:
            return None
        stored |= torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(-1).long() << shift
    row, column = stored // columns, stored % columns
    # A block holds as many rows as column 0 takes positions before another column starts.
    later = (column != 0).nonzero()
    block_rows = int(later[0]) if later.numel() else rows
    row_at = tuple(int(r) for r in row[:block_rows])
    if rows % block_rows or sorted(row_at) != list(range(block_rows)):
        return None
    layout = Int4Layout(torch.backends.cpu.get_cpu_capability(), block_rows, row_at)
    return layout if torch.equal(layout.arrange(stored, rows, columns), index) else None


__all__ = ["Int4Layout", "packing_layout"]
