"""Frozen 4-bit weights decoded to e4m3 in one kernel, for the fp8-base switch.

Why: bitsandbytes turns an NF4 weight back into numbers in two kernels (its double-quantized block scales first,
then the codes), and fp8 products then need a cast and a transposed copy on top. Here one Triton kernel reads the
packed codes and block scales once and writes the whole weight in e4m3. Floating-point contraction is off in the
kernel: a fused multiply-add in the double-quantized scale rounded about one weight in a million differently from
bitsandbytes.

Each code's table value times its block's float32 scale (a double-quantized scale is its 8-bit code's value times its
group's scale plus the stored offset) is rounded to the model's 16-bit dtype, bitsandbytes' own arithmetic, then
(:func:`e4m3_from_4bit`) times the reciprocal of the weight's one e4m3 scale, clamped to e4m3's range and rounded to
nearest, written row-major (forward), transposed (the input gradient), or both from the same read. Against
bitsandbytes' dequantize, a cast and a transposed copy: the two-pass path's bits except for about 2 in a million
weights, one e4m3 step apart (it divides by the scale where this multiplies by its reciprocal). Measured on the H200
(Llama-3.1-8B shape, fp8 everywhere with step graphs): the 448 conversions of a step took 17.9 ms against about
37 ms, and the step went from 320 to 294 ms (benchmarks/qlora_one_pass_h200.md). A 16-bit decode by the same kernel
(bitsandbytes' bits, 12 against 17 ms a step) measured 1.3% of a whole step and went
(docs/speed_switch_gains.md).

The kernel covers bitsandbytes' 2-D NF4 weights (plain or double-quantized block scales) whose rows hold whole
blocks and whose widths are multiples of the tiles; anything else (FP4, not checked against bitsandbytes on a GPU),
and machines without Triton, keep bitsandbytes' path (:func:`covers`). Each conversion is a torch custom op, so
compiled regions call it as one opaque node and CUDA graphs capture it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

__all__ = [
    "TILES",
    "covers",
    "e4m3_from_4bit",
    "four_bit_to_e4m3",
]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448
TILES = {(True, False): (16, 256, 4), (False, True): (64, 64, 4), (True, True): (16, 256, 4)}
"""(rows, packed bytes, warps) per program for each (row-major, transposed) pair of outputs, the fastest measured
on the H200 (14,336 x 4,096 NF4: 0.045, 0.050 and 0.083 ms against 0.118 ms for bitsandbytes' kernel and the cast
alone). A transposed store is contiguous along the tile's rows, so its tile is tall. Writing both layouts from a
tall tile gave wrong transposed values with Triton 3.6, so both come from the wide tile (GPU test)."""


def covers(quant_state: Any) -> bool:
    """Whether the one-pass kernel handles this bitsandbytes 4-bit weight on its device."""
    shape = tuple(getattr(quant_state, "shape", ()))
    blocksize = int(getattr(quant_state, "blocksize", 0) or 0)
    absmax = getattr(quant_state, "absmax", None)
    if len(shape) != 2 or blocksize <= 0 or absmax is None or not absmax.is_cuda:
        return False
    if getattr(quant_state, "quant_type", None) != "nf4" or getattr(quant_state, "code", None) is None:
        return False
    if blocksize % 2 or shape[1] % blocksize:
        return False
    rows, columns = shape
    if rows * columns >= 2**31:  # the kernel's offsets are 32-bit
        return False
    widest = 2 * max(tile[1] for tile in TILES.values())
    tallest = max(tile[0] for tile in TILES.values())
    return columns % widest == 0 and rows % tallest == 0 and _triton_available()


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def e4m3_from_4bit(
    packed: torch.Tensor,
    quant_state: Any,
    scale: torch.Tensor,
    dtype: torch.dtype,
    rows_out: bool,
    transposed_out: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(row-major (out, in) e4m3 weight or None, transposed (in, out) or None) of a covered 4-bit weight whose
    16-bit values would be in ``dtype``."""
    codes, rows, columns, blocksize = _codes(packed, quant_state)
    forward, backward = four_bit_to_e4m3(
        codes, *_block_scales(quant_state), scale.reshape(1).float(), rows, columns, blocksize, dtype, rows_out,
        transposed_out,
    )  # fmt: skip
    return (forward if rows_out else None), (backward if transposed_out else None)


def _codes(packed: torch.Tensor, quant_state: Any) -> tuple[torch.Tensor, int, int, int]:
    """(the packed codes as flat bytes, rows, columns, blocksize) of a 4-bit weight."""
    rows, columns = (int(size) for size in quant_state.shape)
    return packed.reshape(-1).view(torch.uint8), rows, columns, int(quant_state.blocksize)


def _block_scales(
    quant_state: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    """(absmax, absmax2, code2, offset, table, group, nested): the kernel's view of a weight's block scales."""
    nested = bool(getattr(quant_state, "nested", False))
    if nested:
        state2 = quant_state.state2
        absmax2, code2, group = state2.absmax.float(), state2.code.float(), int(state2.blocksize)
        offset = quant_state.offset.reshape(1).float()
    else:  # unread by the kernel: any tensor on the device stands in, so nothing is allocated per call
        absmax2 = code2 = offset = quant_state.absmax
        group = 1
    table = quant_state.code.float()
    return quant_state.absmax.reshape(-1), absmax2.reshape(-1), code2.reshape(-1), offset, table, group, nested


@torch.library.custom_op("tunedeck::four_bit_to_e4m3", mutates_args=())
def four_bit_to_e4m3(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    absmax2: torch.Tensor,
    code2: torch.Tensor,
    offset: torch.Tensor,
    table: torch.Tensor,
    group: int,
    nested: bool,
    scale: torch.Tensor,
    rows: int,
    columns: int,
    blocksize: int,
    dtype: torch.dtype,
    rows_out: bool,
    transposed_out: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (rows, columns) weight packed as 4-bit codes (two per byte, the first in the high half) in e4m3 under
    ``scale``: (row-major, transposed), each an empty tensor unless asked for. ``absmax``: one scale per
    ``blocksize`` codes, float32, or uint8 codes into ``code2`` times ``absmax2`` (one per ``group`` blocks) plus
    ``offset`` when ``nested``; ``table``: the 16 code values; ``dtype``: the 16-bit type the values round to first,
    as the two-pass path's do."""
    forward, backward = _outputs(packed.device, rows, columns, rows_out, transposed_out)
    _launch(
        packed, absmax, absmax2, code2, offset, table, group, nested, scale, forward, backward, rows, columns,
        blocksize, dtype, to_e4m3=True, rows_out=rows_out, transposed_out=transposed_out,
    )  # fmt: skip
    return forward, backward


@four_bit_to_e4m3.register_fake
def _(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    absmax2: torch.Tensor,
    code2: torch.Tensor,
    offset: torch.Tensor,
    table: torch.Tensor,
    group: int,
    nested: bool,
    scale: torch.Tensor,
    rows: int,
    columns: int,
    blocksize: int,
    dtype: torch.dtype,
    rows_out: bool,
    transposed_out: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(packed.device, rows, columns, rows_out, transposed_out)


def _launch(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    absmax2: torch.Tensor,
    code2: torch.Tensor,
    offset: torch.Tensor,
    table: torch.Tensor,
    group: int,
    nested: bool,
    scale: torch.Tensor,
    forward: torch.Tensor,
    backward: torch.Tensor,
    rows: int,
    columns: int,
    blocksize: int,
    dtype: torch.dtype,
    to_e4m3: bool,
    rows_out: bool,
    transposed_out: bool,
) -> None:
    tile_rows, tile_bytes, warps = TILES[(rows_out, transposed_out)]
    grid = (rows // tile_rows, columns // 2 // tile_bytes)
    on_its_device = torch.cuda.device(packed.device) if packed.is_cuda else contextlib.nullcontext()
    with on_its_device:  # Triton launches on the current device, which need not be the weight's
        _kernel()[grid](
            packed, absmax, absmax2, code2, offset, table, scale, forward, backward, rows, columns,
            BLOCKSIZE=blocksize, GROUP=group, NESTED=nested, ROUND_TO=_triton_dtype(dtype), TO_E4M3=to_e4m3,
            ROWS_OUT=rows_out, TRANSPOSED_OUT=transposed_out, TILE_R=tile_rows, TILE_B=tile_bytes, num_warps=warps,
            enable_fp_fusion=False,  # a double-quantized scale is a product, then a sum, as bitsandbytes rounds it
        )  # fmt: skip


def _outputs(
    device: torch.device, rows: int, columns: int, rows_out: bool, transposed_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    forward = torch.empty((rows, columns) if rows_out else (0,), dtype=E4M3, device=device)
    backward = torch.empty((columns, rows) if transposed_out else (0,), dtype=E4M3, device=device)
    return forward, backward


def _triton_dtype(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return tl.float16 if dtype == torch.float16 else tl.bfloat16


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, built on first use (Triton is only imported where it runs).

    A program reads a ``TILE_R`` x ``TILE_B`` tile of packed bytes once, looks up both codes of each byte and
    scales them by their block's scale (computed per byte, a cache hit for the 32 bytes of a 64-code block),
    interleaves them back into ``2 * TILE_B`` 16-bit weights per row, casts them to e4m3 under ``scale`` when
    ``TO_E4M3``, and stores the tile as it is, transposed, or both.
    """
    import triton
    import triton.language as tl

    # a Triton kernel: its parameters are pointers and scalars that Triton types at launch, and Triton is untyped
    @triton.jit  # type: ignore[untyped-decorator]
    def four_bit_decode_kernel(  # type: ignore[no-untyped-def]
        packed, absmax, absmax2, code2, offset, table, scale, forward, backward, rows, columns,
        BLOCKSIZE: tl.constexpr, GROUP: tl.constexpr, NESTED: tl.constexpr, ROUND_TO: tl.constexpr,
        TO_E4M3: tl.constexpr, ROWS_OUT: tl.constexpr, TRANSPOSED_OUT: tl.constexpr, TILE_R: tl.constexpr,
        TILE_B: tl.constexpr,
    ):  # fmt: skip  # pragma: no cover - runs on the GPU or under Triton's interpreter
        row = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
        first_byte = tl.program_id(1) * TILE_B
        byte = first_byte + tl.arange(0, TILE_B)
        codes = tl.load(packed + row[:, None] * (columns // 2) + byte[None, :]).to(tl.int32)
        block = row[:, None] * (columns // BLOCKSIZE) + byte[None, :] // (BLOCKSIZE // 2)
        if NESTED:
            block_scale = tl.load(code2 + tl.load(absmax + block).to(tl.int32)) * tl.load(absmax2 + block // GROUP)
            block_scale = block_scale + tl.load(offset)
        else:
            block_scale = tl.load(absmax + block)
        high = (tl.load(table + (codes >> 4)) * block_scale).to(ROUND_TO)
        low = (tl.load(table + (codes & 15)) * block_scale).to(ROUND_TO)
        tile = tl.reshape(tl.join(high, low), (TILE_R, 2 * TILE_B))  # the high code is the even column
        if TO_E4M3:
            tile = tile.to(tl.float32) * (1.0 / tl.load(scale))
            tile = tl.minimum(tl.maximum(tile, -448.0), 448.0).to(tl.float8e4nv)
        column = 2 * first_byte + tl.arange(0, 2 * TILE_B)
        if ROWS_OUT:
            tl.store(forward + row[:, None] * columns + column[None, :], tile)
        if TRANSPOSED_OUT:
            tl.store(backward + column[:, None] * rows + row[None, :], tl.trans(tile))

    return four_bit_decode_kernel


def dense_weight(weight: torch.Tensor, quant_state: Any, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) weight in ``dtype``: dequantized by bitsandbytes from 4 bits when there is a quantization
    state."""
    if quant_state is None:
        return weight.to(dtype)
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(weight, quant_state).to(dtype)
