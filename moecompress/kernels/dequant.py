"""Dequantisation on CPU at memory speed (numba): one pass reads the packed codes and the group scales and writes
the output dtype's bits, each weight a lookup in a table of values.

Every table entry is computed once, by the reference's own functions (the ones ``QuantScheme.values`` calls)
followed by its ``.to(dtype)``, so the output is bit-identical to ``QuantizedTensor._dequantize_reference``:

- MXFP4: ``[256 E8M0 scales, 16 codes]``;
- INT4 / INT2 (and W4A8's weights): a weight is ``(c - z) * s`` rounded to bfloat16, a function of the bf16 scale
  bits and of ``d = c - z``, so ``[65536 scales, 2 * (2**bits - 1) + 1 differences]`` covers every zero point in
  ``0 .. 2**bits - 1`` (the ones the quantiser writes; others take the reference path);
- binary: ``[65536 scales, 2 codes]`` (``-s``, ``+s``), read once per group; 32 codes at a time select between
  the two (a vector blend, no lookup per weight).

With 16-bit outputs (bf16, float16), MXFP4 and INT4 groups of a multiple of 32 weights load their 16 table entries
into one register and permute them by 32 codes at a time (AVX-512BW ``vpermw``), where numba compiles for a CPU
that has it; elsewhere each weight is looked up.

Salient weights (flat positions, values as ``dtype``) are written by the same pass, each row's right after the row
is decoded, while it is in cache; positions the kernels cannot vouch for (out of order, repeated, negative) are
left to torch's ``index_put_``, the reference's own write.

Tables are built on first use per output dtype (the INT4 one is 4 MiB in bf16). Nothing but the output is
allocated per call: no float32 copy, no unpacked codes. The functions return None when the layout is not one the
kernels read, and the caller takes the reference path.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import binary as binary_codes
from . import intq
from . import mxfp4 as mxfp4_codes
from .numba_threads import torch_thread_count

_BITS_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_ONE, _TWO, _THREE, _FOUR, _SIX = (np.uint64(k) for k in (1, 2, 3, 4, 6))
_LOW2, _LOW4 = np.uint64(3), np.uint64(15)


_ROW_BLOCK = 32


@njit(cache=True)
def _salient_row(positions, values, index, row, out_row):
    """Writes the salient ``values`` whose flat ``positions`` fall in ``row``, from ``positions[index]`` on, over
    the decoded row while it is in cache, and returns the index after them. The run stops at the first position
    outside the row or not above the one before: when the runs of all rows add up to every position, each was
    written once (runs of different rows hold different positions), as ``index_put_`` writes them."""
    cols = out_row.shape[0]
    first = row * cols
    previous, end = first - 1, first + cols
    while index < positions.shape[0]:
        position = positions[index]
        if position >= end or position <= previous:
            break
        out_row[position - first] = values[index]
        previous = position
        index += 1
    return index


@njit(cache=True)
def _nibble_group(packed_row, out_row, flat, base, start, stop):
    """Weights ``start:stop`` of a row of 4-bit codes (low nibble first), each looked up at ``flat[base + c]``."""
    for b in range(start >> _ONE, stop >> _ONE):
        byte = np.uint64(packed_row[b])
        out_row[b << _ONE] = flat[base + (byte & _LOW4)]
        out_row[(b << _ONE) + _ONE] = flat[base + (byte >> _FOUR)]


@njit(cache=True)
def _crumb_group(packed_row, out_row, flat, base, start, stop):
    """Weights ``start:stop`` of a row of 2-bit codes (lowest bits first), each looked up at ``flat[base + c]``."""
    for b in range(start >> _TWO, stop >> _TWO):
        byte = np.uint64(packed_row[b])
        first = b << _TWO
        out_row[first] = flat[base + (byte & _LOW2)]
        out_row[first + _ONE] = flat[base + ((byte >> _TWO) & _LOW2)]
        out_row[first + _TWO] = flat[base + ((byte >> _FOUR) & _LOW2)]
        out_row[first + _THREE] = flat[base + (byte >> _SIX)]


_SIGN_LANES = 32


@intrinsic
def _store_signs(typingctx, packed_row, byte_index, out_row, out_index, negative, positive):
    """``out_row[out_index : out_index + 32]`` = ``positive`` where bit ``k`` of the little-endian 32-bit word at
    ``packed_row[byte_index]`` is set, else ``negative``: one vector select on the word as a 32-lane mask, which
    LLVM lowers to a mask-register blend and full-width stores (generic IR; any target legalises it)."""
    if packed_row.layout != "C" or out_row.layout != "C":
        return None
    element = out_row.dtype
    signature = types.void(packed_row, byte_index, out_row, out_index, negative, positive)

    def codegen(context, builder, sig, args):
        packed, byte_at, out, out_at, negative_value, positive_value = args
        vector = ir.VectorType(context.get_value_type(element), _SIGN_LANES)
        lane_zeros = ir.Constant(ir.VectorType(ir.IntType(32), _SIGN_LANES), [0] * _SIGN_LANES)

        def splat(value, value_type):
            scalar = context.cast(builder, value, value_type, element)
            first = builder.insert_element(ir.Constant(vector, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
            return builder.shuffle_vector(first, ir.Constant(vector, ir.Undefined), lane_zeros)

        packed_data = context.make_array(sig.args[0])(context, builder, packed).data
        word_at = builder.bitcast(builder.gep(packed_data, [byte_at]), ir.IntType(_SIGN_LANES).as_pointer())
        mask = builder.bitcast(builder.load(word_at, align=1), ir.VectorType(ir.IntType(1), _SIGN_LANES))
        chosen = builder.select(mask, splat(positive_value, sig.args[5]), splat(negative_value, sig.args[4]))
        out_data = context.make_array(sig.args[2])(context, builder, out).data
        out_at_vector = builder.bitcast(builder.gep(out_data, [out_at]), vector.as_pointer())
        builder.store(chosen, out_at_vector, align=element.bitwidth // 8)
        return context.get_dummy_value()

    return signature, codegen


@njit(cache=True)
def _sign_group(packed_row, out_row, flat, base, start, stop):
    """Weights ``start:stop`` of a row of sign bits: ``flat[base + 1]`` (``+s``) for 1, ``flat[base]`` for 0, 32
    codes at a time."""
    negative, positive = flat[base], flat[base + _ONE]
    for first in range(start, stop, np.uint64(_SIGN_LANES)):
        _store_signs(packed_row, first >> _THREE, out_row, first, negative, positive)


def _permutes_words() -> bool:
    """Whether numba compiles for this CPU (no ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``) and it has AVX-512BW's
    ``vpermw``, which :func:`_store_nibble_lookup` calls by name (an x86 intrinsic, unlike ``_store_signs``'s
    generic IR)."""
    from llvmlite import binding
    from numba import config

    if config.CPU_NAME not in (None, "host") or config.CPU_FEATURES:
        return False
    return bool(binding.get_host_cpu_features().get("avx512bw", False))


_PERMUTES_WORDS = _permutes_words()
_NIBBLE_LANES = 32


@intrinsic
def _store_nibble_lookup(typingctx, packed_row, byte_index, out_row, out_index, flat, table_index):
    """``out_row[out_index : out_index + 32]`` = ``flat[table_index + c]`` for the 32 4-bit codes ``c`` of the 16
    bytes at ``packed_row[byte_index]`` (low nibble first): the 16 table entries in one register, permuted by the
    codes (``vpermw``). 16-bit outputs only; callers check :data:`_PERMUTES_WORDS`."""
    if packed_row.layout != "C" or out_row.layout != "C" or out_row.dtype.bitwidth != 16:
        return None
    signature = types.void(packed_row, byte_index, out_row, out_index, flat, table_index)

    def codegen(context, builder, sig, args):
        packed, byte_at, out, out_at, table, table_at = args
        word, byte = ir.IntType(16), ir.IntType(8)
        words = ir.VectorType(word, _NIBBLE_LANES)
        half = _NIBBLE_LANES // 2

        def data(position, value):
            return context.make_array(sig.args[position])(context, builder, value).data

        codes_at = builder.bitcast(builder.gep(data(0, packed), [byte_at]), ir.VectorType(byte, half).as_pointer())
        codes = builder.zext(builder.load(codes_at, align=1), ir.VectorType(word, half))
        low = builder.and_(codes, ir.Constant(ir.VectorType(word, half), [15] * half))
        high = builder.lshr(codes, ir.Constant(ir.VectorType(word, half), [4] * half))
        interleaved = [lane // 2 + (lane % 2) * half for lane in range(_NIBBLE_LANES)]
        indices = builder.shuffle_vector(
            low, high, ir.Constant(ir.VectorType(ir.IntType(32), _NIBBLE_LANES), interleaved)
        )
        entries_at = builder.bitcast(builder.gep(data(4, table), [table_at]), ir.VectorType(word, half).as_pointer())
        entries = builder.load(entries_at, align=2)
        widened = builder.shuffle_vector(
            entries, entries, ir.Constant(ir.VectorType(ir.IntType(32), _NIBBLE_LANES), list(range(_NIBBLE_LANES)))
        )
        permute = builder.module.declare_intrinsic(
            "llvm.x86.avx512.permvar.hi.512", fnty=ir.FunctionType(words, [words, words])
        )
        chosen = builder.call(permute, [widened, indices])
        out_at_vector = builder.bitcast(builder.gep(data(2, out), [out_at]), words.as_pointer())
        builder.store(chosen, out_at_vector, align=2)
        return context.get_dummy_value()

    return signature, codegen


@njit(cache=True)
def _nibble_permute_group(packed_row, out_row, flat, base, start, stop):
    """:func:`_nibble_group` 32 codes at a time through :func:`_store_nibble_lookup` (16-bit outputs, groups of a
    multiple of 32 weights)."""
    for first in range(start, stop, np.uint64(_NIBBLE_LANES)):
        _store_nibble_lookup(packed_row, first >> _ONE, out_row, first, flat, base)


_NIBBLES, _CRUMBS, _SIGNS, _PERMUTED_NIBBLES = range(4)
"""The layouts of codes, each written by its own group writer: :func:`_nibble_group`, :func:`_crumb_group`,
:func:`_sign_group`, :func:`_nibble_permute_group`."""


def _rows_kernel(codes: int):
    """The pass every format shares, compiled for one layout of ``codes``: rows in blocks of :data:`_ROW_BLOCK` over
    the threads, each row's groups written by the layout's group writer, then the row's salient values while it is
    in cache; the kernel returns how many salient values it wrote. A group's table entries start at row ``scale``
    of ``table``, column ``span - zero`` (``zero``: the group's entry in ``zeros`` ``[rows, groups]``, or
    ``default_zero`` where ``zeros`` is empty); ``span`` and ``default_zero`` are 0 for a table without zero points.

    ``codes`` is a constant of the kernel, so numba compiles the one writer's branch (the others are pruned before
    typing: the ``vpermw`` writer types for 16-bit outputs alone) and caches each layout's kernel apart (numba's
    cache misses on a kernel that takes its writer as an argument: a function's cache key changes per process)."""

    @njit(parallel=True, cache=True)
    def decode_rows(packed, scales, zeros, default_zero, span, group_size, table, positions, values, out):
        rows, groups = scales.shape
        flat = table.ravel()
        width = np.uint64(table.shape[1])
        group_weights = np.uint64(group_size)
        written = 0
        for block in prange((rows + _ROW_BLOCK - 1) // _ROW_BLOCK):
            start_row = block * _ROW_BLOCK
            index = begin = np.searchsorted(positions, start_row * out.shape[1])
            for row in range(start_row, min(rows, start_row + _ROW_BLOCK)):
                packed_row, out_row, scale_row = packed[row], out[row], scales[row]
                for group in range(groups):
                    zero = default_zero if zeros.shape[0] == 0 else np.int64(zeros[row, group])
                    base = np.uint64(scale_row[group]) * width + np.uint64(span - zero)
                    start = np.uint64(group) * group_weights
                    stop = start + group_weights
                    if codes == _NIBBLES:
                        _nibble_group(packed_row, out_row, flat, base, start, stop)
                    elif codes == _CRUMBS:
                        _crumb_group(packed_row, out_row, flat, base, start, stop)
                    elif codes == _SIGNS:
                        _sign_group(packed_row, out_row, flat, base, start, stop)
                    else:
                        _nibble_permute_group(packed_row, out_row, flat, base, start, stop)
                index = _salient_row(positions, values, index, row, out_row)
            written += index - begin
        return written

    return decode_rows


_ROWS_KERNELS = {codes: _rows_kernel(codes) for codes in (_NIBBLES, _CRUMBS, _SIGNS, _PERMUTED_NIBBLES)}


_TABLES: dict[tuple, np.ndarray] = {}


def _as_bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(_BITS_DTYPES[tensor.element_size()]).numpy()


def _bf16_scales() -> torch.Tensor:
    """The float32 value of every bfloat16 bit pattern, indexed by the pattern."""
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def _table(kind: str, dtype: torch.dtype, bits: int = 0) -> np.ndarray:
    key = (kind, dtype, bits)
    if key not in _TABLES:
        if kind == "mxfp4":
            exponents = torch.arange(256, dtype=torch.int32) - mxfp4_codes.E8M0_BIAS
            codes = torch.arange(16, dtype=torch.uint8)
            values = mxfp4_codes.e2m1_values(codes)[None, :] * mxfp4_codes.power_of_two(exponents)[:, None]
        elif kind == "int":
            span = (1 << bits) - 1
            differences = torch.arange(-span, span + 1, dtype=torch.float32)[None, :]
            grid = intq.IntGrid(_bf16_scales()[:, None], torch.zeros(1, 1))
            values = intq.grid_values(differences, grid)
        else:
            values = binary_codes.sign_values(torch.arange(2, dtype=torch.uint8)[None, :], _bf16_scales()[:, None])
        _TABLES[key] = _as_bits(values.to(dtype)).copy()
    return _TABLES[key]


def _rows(tensor: torch.Tensor, shape: tuple[int, ...], width: int, dtype: torch.dtype) -> np.ndarray | None:
    """``tensor`` as a contiguous ``[rows, width]`` numpy array (bf16 as its uint16 bits) when it has shape
    ``shape[:-1] + (width,)`` and ``dtype`` and lives on the CPU, else None."""
    if tensor.dtype != dtype or tuple(tensor.shape) != (*shape[:-1], width) or tensor.device.type != "cpu":
        return None
    rows = tensor.detach().contiguous().reshape(-1, width)
    if dtype == torch.bfloat16:
        return rows.view(torch.int16).numpy().view(np.uint16)
    return rows.numpy()


def _supported(shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    if not dtype.is_floating_point or torch.empty(0, dtype=dtype).element_size() not in _BITS_DTYPES:
        return False
    return bool(shape) and math.prod(shape) > 0


_NUMPY_BITS = {2: np.int16, 4: np.int32, 8: np.int64}


def _salient_arrays(
    salient: tuple[torch.Tensor, torch.Tensor] | None, dtype: torch.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' salient inputs: flat int64 positions and the values as ``dtype``'s bits (the reference's
    ``values.to(dtype)``); empty when there are none or they are not int64 / on the CPU (then torch writes them)."""
    bits = _NUMPY_BITS[torch.empty(0, dtype=dtype).element_size()]
    if salient is not None:
        positions, values = salient
        usable = positions.dtype == torch.int64 and positions.shape == values.shape and positions.dim() == 1
        if usable and positions.device.type == "cpu" and values.device.type == "cpu":
            return positions.contiguous().numpy(), _as_bits(values.to(dtype).contiguous())
    return np.empty(0, np.int64), np.empty(0, bits)


def _finish(out: torch.Tensor, written: int, salient: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``out``, with the salient values written by torch (``SalientWeights.apply``'s write) unless the kernel
    wrote every one of them."""
    if salient is not None and written != salient[0].numel():
        positions, values = salient
        out.view(-1)[positions] = values.to(out.dtype)
    return out


def _output(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """A ``dtype`` tensor and its bits as a ``[rows, cols]`` numpy array. numpy allocates it: it asks Linux for
    transparent huge pages and its memory is reused across calls, where ``torch.empty`` took a page fault every
    4 KiB on each call (measured: 3,072 faults and 2.5x the time for a 12 MiB output)."""
    bits = np.empty(shape, _NUMPY_BITS[torch.empty(0, dtype=dtype).element_size()])
    return torch.from_numpy(bits).view(dtype), bits.reshape(-1, shape[-1])


_NO_ZEROS = np.zeros((0, 0), np.uint8)


def _permutes(dtype: torch.dtype, group_size: int) -> bool:
    """Whether 4-bit groups of ``group_size`` decode to ``dtype`` as :data:`_PERMUTED_NIBBLES`."""
    return _PERMUTES_WORDS and dtype.itemsize == 2 and group_size % _NIBBLE_LANES == 0


def _decode(
    codes: int,
    packed_rows: np.ndarray,
    scale_rows: np.ndarray,
    zero_rows: np.ndarray,
    default_zero: int,
    span: int,
    group_size: int,
    table: np.ndarray,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    salient: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """The ``dtype`` ``shape`` output of the ``codes`` layout's kernel (:func:`_rows_kernel`) on torch's thread
    count, with the salient weights."""
    out, out_rows = _output(shape, dtype)
    with torch_thread_count():
        written = _ROWS_KERNELS[codes](
            packed_rows,
            scale_rows,
            zero_rows,
            default_zero,
            span,
            group_size,
            table,
            *_salient_arrays(salient, dtype),
            out_rows,
        )
    return _finish(out, written, salient)


def mxfp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    salient: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """MXFP4 codes ``[..., K/2]`` and E8M0 scales ``[..., K/32]`` as ``dtype`` ``shape`` ``[..., K]``, with the
    ``salient`` weights (flat positions, values) written over it."""
    if not _supported(shape, dtype) or shape[-1] % mxfp4_codes.BLOCK_SIZE:
        return None
    packed_rows = _rows(packed, shape, shape[-1] // 2, torch.uint8)
    scale_rows = _rows(scales, shape, shape[-1] // mxfp4_codes.BLOCK_SIZE, torch.uint8)
    if packed_rows is None or scale_rows is None:
        return None
    group_size = mxfp4_codes.BLOCK_SIZE
    codes = _PERMUTED_NIBBLES if _permutes(dtype, group_size) else _NIBBLES
    table = _table("mxfp4", dtype)
    return _decode(codes, packed_rows, scale_rows, _NO_ZEROS, 0, 0, group_size, table, shape, dtype, salient)


def integer(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    salient: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """INT4 / INT2 codes with bf16 group scales and (asymmetric) uint8 zero points, as ``dtype`` ``shape``, with
    the ``salient`` weights (flat positions, values) written over it."""
    if not _supported(shape, dtype) or bits not in (2, 4) or shape[-1] % group_size or group_size % 8:
        return None
    groups = shape[-1] // group_size
    packed_rows = _rows(packed, shape, shape[-1] * bits // 8, torch.uint8)
    scale_rows = _rows(scales, shape, groups, torch.bfloat16)
    if zeros is None:
        zero_rows = _NO_ZEROS
    else:
        zero_rows = _rows(zeros, shape, groups, torch.uint8)
        if zero_rows is not None and int(zero_rows.max()) >= 1 << bits:
            zero_rows = None
    if packed_rows is None or scale_rows is None or zero_rows is None:
        return None
    if bits == 2:
        codes = _CRUMBS
    else:
        codes = _PERMUTED_NIBBLES if _permutes(dtype, group_size) else _NIBBLES
    table = _table("int", dtype, bits)
    span = (1 << bits) - 1
    return _decode(
        codes, packed_rows, scale_rows, zero_rows, 1 << (bits - 1), span, group_size, table, shape, dtype, salient
    )


def binary(
    packed: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    salient: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Sign bits ``[..., K/8]`` with bf16 group scales ``[..., K/G]`` as ``dtype`` ``shape`` (``+s`` for 1), with
    the ``salient`` weights (flat positions, values) written over it."""
    if not _supported(shape, dtype) or shape[-1] % group_size or group_size % _SIGN_LANES:
        return None
    packed_rows = _rows(packed, shape, shape[-1] // 8, torch.uint8)
    scale_rows = _rows(scales, shape, shape[-1] // group_size, torch.bfloat16)
    if packed_rows is None or scale_rows is None:
        return None
    table = _table("binary", dtype)
    return _decode(_SIGNS, packed_rows, scale_rows, _NO_ZEROS, 0, 0, group_size, table, shape, dtype, salient)
