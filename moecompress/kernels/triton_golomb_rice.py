"""Chunk-parallel decoding of :mod:`.golomb_rice` containers into set-bit positions: one program per chunk,
started from the chunk's table entry (bitmap position, quotient bit offset, Golomb extension bit offset).

A program reads its chunk's unary quotients a window of ``BLOCK`` bits at a time. In a window, the ``l``-th
one bit ends symbol ``l``; the zeros before it are the quotients of symbols up to ``l``, so with the remainders'
inclusive prefix sum ``R_l`` the position is ``base + m·zeros_before + R_l + l`` (``base`` where the window's
first run starts). A symbol's remainder field is gathered from the bit planes (bit ``p·c + i`` of the payload
for plane ``p`` and symbol ``i``); Golomb's extension bits are taken in order by a prefix count of the long
fields. A window with no one bit only moves ``base`` on by ``m`` per zero. ``decode_indices`` (numpy) is the
reference.

Only the header and table are checked (by the reference parser) before the launch; every read is masked to the
payload and every loop to the chunk's quotient bits, so a corrupt payload cannot make the kernel read out of
bounds or spin, and the output is checked to be strictly increasing and inside the bitmap afterwards.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import golomb_rice


@triton.jit
def _payload_bits(payload_ptr, offsets, limit):
    byte = tl.load(payload_ptr + (offsets >> 3), mask=offsets < limit, other=0).to(tl.int32)
    return (byte >> (7 - (offsets & 7).to(tl.int32))) & 1


@triton.jit
def _decode_chunk_kernel(
    payload_ptr,
    table_ptr,
    out_ptr,
    ones,
    chunk_symbols,
    payload_bits,
    modulus,
    width,
    cutoff,
    FIELDS: tl.constexpr,
    EXTENDED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    chunk = tl.program_id(0)
    chunks = tl.cdiv(ones + 1, chunk_symbols)
    first = chunk.to(tl.int64) * chunk_symbols
    count = tl.minimum(ones + 1 - first, chunk_symbols)
    base = tl.load(table_ptr + chunk * FIELDS)
    bit = tl.load(table_ptr + chunk * FIELDS + 1)
    if EXTENDED:
        extension = tl.load(table_ptr + chunk * FIELDS + 2)
    else:
        extension = bit * 0
    next_chunk = tl.minimum(chunk + 1, chunks - 1) * FIELDS + 1
    end = tl.where(chunk + 1 < chunks, tl.load(table_ptr + next_chunk), payload_bits)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    done = first * 0
    while (done < count) & (bit < end):
        unary = _payload_bits(payload_ptr, bit + lanes, end).to(tl.int64)
        symbol_in_window = tl.cumsum(unary, 0) - 1
        take = (unary == 1) & (done + symbol_in_window < count)
        symbol = first + done + symbol_in_window
        has_field = take & (symbol < ones)
        field = lanes * 0
        for plane in range(width):
            field = (field << 1) | _payload_bits(payload_ptr, plane * ones + symbol, payload_bits).to(tl.int64)
        field = tl.where(has_field, field, 0)
        if EXTENDED:
            long_code = has_field & (field >= cutoff)
            rank = tl.cumsum(long_code.to(tl.int64), 0) - long_code.to(tl.int64)
            extra = _payload_bits(payload_ptr, extension + rank, payload_bits).to(tl.int64)
            field = tl.where(long_code, 2 * field + extra - cutoff, field)
            extension += tl.sum(long_code.to(tl.int64), 0)
        position = base + modulus * (lanes - symbol_in_window) + tl.cumsum(field, 0) + symbol_in_window
        tl.store(out_ptr + symbol, position, mask=has_field)
        taken = tl.sum(take.to(tl.int64), 0)
        if taken > 0:
            last = tl.max(tl.where(take, lanes, -1), 0)
            base = tl.max(tl.where(take, position, -1), 0) + 1
            bit += last + 1
            done += taken
        else:
            base += modulus * BLOCK
            bit += BLOCK


class GPUContainer:
    """A parsed container's payload and table on ``device``, ready for :func:`decode_positions`."""

    def __init__(self, data: bytes | bytearray | memoryview, device: torch.device | str):
        container = golomb_rice._parse(data)
        self.scheme = container.scheme
        self.length, self.ones, self.chunk_symbols = container.length, container.ones, container.chunk_symbols
        self.chunks = container.chunks
        payload = np.concatenate([container.payload, np.zeros(1, dtype=np.uint8)])
        self.payload = torch.from_numpy(payload).to(device)
        self.payload_bits = container.payload.size * 8
        self.table = torch.from_numpy(np.ascontiguousarray(container.table)).to(device)
        self.coded_bytes = len(data)


def decode_positions(container: GPUContainer, block: int = 1024, check: bool = True) -> torch.Tensor:
    """int64 set-bit positions of ``container``, decoded on its device (the Triton twin of
    :func:`.golomb_rice.decode_indices`); ``check`` raises ``ValueError`` unless they are strictly increasing and
    inside the bitmap (one host sync)."""
    scheme = container.scheme
    out = torch.full((container.ones,), -1, dtype=torch.int64, device=container.payload.device)
    if container.ones == 0:
        return out
    _decode_chunk_kernel[(container.chunks,)](
        container.payload,
        container.table,
        out,
        container.ones,
        container.chunk_symbols,
        container.payload_bits,
        scheme.modulus,
        scheme.width,
        scheme.cutoff,
        FIELDS=golomb_rice.ENTRY_FIELDS[scheme.code],
        EXTENDED=scheme.extended,
        BLOCK=block,
    )
    if check:
        ordered = bool((out[1:] > out[:-1]).all()) if out.numel() > 1 else True
        if not ordered or int(out[0]) < 0 or int(out[-1]) >= container.length:
            raise ValueError("corrupt Golomb-Rice payload: decoded positions are not a bitmap's")
    return out
