"""GGML's block formats, bit for bit: the k-quants' 256-weight super-blocks (``Q2_K`` .. ``Q6_K``) and the 32-weight
blocks llama.cpp falls back to for rows whose width is not a multiple of 256 (``Q4_0``, ``Q5_0``, ``Q5_1``,
``Q8_0``), and ``IQ4_NL``.

Each format is a list of fields in GGML's order. Fitting works on float32 blocks ``[n, block]`` with per-weight
importance ``[n, block]``; the sub-block scales and mins are fitted by weighted least squares over a few candidate
steps, quantised to the format's scale bits against the fp16 super-block scales, and the codes are then rounded
against exactly the values the decoder computes (all at once in :meth:`BlockFormat.encode`, or column by column
in GPTQ). Decoding is the float32 arithmetic of ``gguf.quants`` in the same order, so both give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

QK_K = 256
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


Fit = Callable[[torch.Tensor, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]]
Rounding = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class BlockFormat:
    """``fields``: (name, bytes, part) in GGML's order; ``part`` ``q`` (quants: our packed tensor) or ``s``
    (scales: our scales tensor). A block is sub-blocks of ``sub`` weights, each with a decoded step (and offset):

    - ``fit(x, w)``: blocks ``[n, block]`` and their importance → the scale fields and the steps and offsets
      ``[n, block // sub]`` (offsets None where the format has none) they decode to;
    - ``grid(fields)``: the steps and offsets stored scale fields decode to;
    - ``codes(x, step, offset)`` / ``values(codes, step, offset)``: rounding to unsigned codes and the decoder's
      float32 values, elementwise (broadcast), so GPTQ can round one column at a time;
    - ``pack(codes)`` / ``unpack(fields)``: codes ``[n, block]`` ↔ the quant fields.
    """

    name: str
    block: int
    sub: int
    fields: tuple[tuple[str, int, str], ...]
    fit: Fit
    grid: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor | None]]
    codes: Rounding
    values: Rounding
    pack: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    unpack: Callable[[dict[str, torch.Tensor]], torch.Tensor]

    def part_bytes(self, part: str) -> int:
        return sum(size for _, size, kind in self.fields if kind == part)

    @property
    def block_bytes(self) -> int:
        return sum(size for _, size, _ in self.fields)

    def encode(self, x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every field of the blocks ``x`` ``[n, block]`` fitted with importance ``w``."""
        scale_fields, step, offset = self.fit(x, w)
        q = self.codes(self._subblocks(x), *_per_subblock(step, offset))
        return {**scale_fields, **self.pack(q.reshape(x.shape[0], self.block))}

    def decode(self, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        q = self.unpack(fields)
        values = self.values(self._subblocks(q), *_per_subblock(*self.grid(fields)))
        return values.reshape(q.shape[0], self.block)

    def _subblocks(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], self.block // self.sub, self.sub)


def _per_subblock(step: torch.Tensor, offset: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    return step.unsqueeze(-1), None if offset is None else offset.unsqueeze(-1)


# ---- bytes ----------------------------------------------------------------------------------------------------
def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).float().reshape(-1, 1)


def _nibbles(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    return (low.to(torch.uint8) & 15) | ((high.to(torch.uint8) & 15) << 4)


def _bit_planes(bits: torch.Tensor, planes: int) -> torch.Tensor:
    """``bits`` ``[n, planes, k]`` of ``width = 8 / planes`` bits each → bytes ``[n, k]``, plane ``p`` at bit
    ``p·width``."""
    width = 8 // planes
    out = torch.zeros(bits.shape[0], bits.shape[2], dtype=torch.uint8, device=bits.device)
    for plane in range(planes):
        out |= (bits[:, plane].to(torch.uint8) & ((1 << width) - 1)) << (plane * width)
    return out


def _planes(raw: torch.Tensor, planes: int) -> torch.Tensor:
    """Inverse of :func:`_bit_planes`: bytes ``[n, k]`` → ``[n, planes, k]``."""
    width = 8 // planes
    return torch.stack([(raw >> (plane * width)) & ((1 << width) - 1) for plane in range(planes)], dim=1)


# ---- fitting --------------------------------------------------------------------------------------------------
def _fit_affine(x: torch.Tensor, w: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``x`` ``[..., S]``: scale ``s >= 0`` and min ``m >= 0`` with ``x ≈ s·q - m``, ``q`` in
    ``0..levels``, minimising the ``w``-weighted squared error over candidate steps (llama.cpp's rmin -1, rdelta
    0.1, 20 steps) each refined by least squares."""
    low = x.amin(dim=-1, keepdim=True).clamp_max(0)
    span = x.amax(dim=-1, keepdim=True) - low
    flat = span <= 0
    span = torch.where(flat, torch.ones_like(span), span)
    best_scale = (span / levels).squeeze(-1)
    best_min = low.squeeze(-1)
    q = torch.round((x - low) * levels / span).clamp(0, levels)
    best_err = (w * (best_scale.unsqueeze(-1) * q + low - x) ** 2).sum(-1)
    sw = w.sum(-1)
    sx = (w * x).sum(-1)
    for step in range(21):
        iscale = (levels - 1 + 0.1 * step) / span
        q = torch.round(iscale * (x - low)).clamp(0, levels)
        sl, sl2, sxl = (w * q).sum(-1), (w * q * q).sum(-1), (w * x * q).sum(-1)
        det = sw * sl2 - sl * sl
        ok = det > 0
        det = torch.where(ok, det, torch.ones_like(det))
        scale = (sw * sxl - sx * sl) / det
        minimum = (sl2 * sx - sl * sxl) / det
        positive = minimum > 0
        scale = torch.where(positive, sxl / sl2.clamp_min(1e-30), scale)
        minimum = torch.where(positive, torch.zeros_like(minimum), minimum)
        err = (w * (scale.unsqueeze(-1) * q + minimum.unsqueeze(-1) - x) ** 2).sum(-1)
        better = ok & (err < best_err) & (scale >= 0)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, minimum, best_min)
        best_err = torch.where(better, err, best_err)
    flat = flat.squeeze(-1)
    return torch.where(flat, torch.zeros_like(best_scale), best_scale), -torch.where(flat, low.squeeze(-1), best_min)


def _fit_symmetric(x: torch.Tensor, w: torch.Tensor, nmax: int) -> torch.Tensor:
    """Per row of ``x`` ``[..., S]``: a signed scale ``s`` with ``x ≈ s·q``, ``q`` in ``-nmax..nmax-1`` (the
    largest-magnitude weight near ``-nmax``), best of 19 candidate steps each refined by weighted least squares."""
    index = x.abs().argmax(dim=-1, keepdim=True)
    peak = x.gather(-1, index)
    zero = peak == 0
    peak = torch.where(zero, torch.ones_like(peak), peak)
    best_scale = (-peak / nmax).squeeze(-1)
    best_score = torch.full_like(best_scale, -1.0)
    for step in range(-9, 10):
        iscale = -(nmax + 0.1 * step) / peak
        q = torch.round(iscale * x).clamp(-nmax, nmax - 1)
        sxl, sl2 = (w * x * q).sum(-1), (w * q * q).sum(-1)
        ok = sl2 > 0
        score = torch.where(ok, sxl * sxl / sl2.clamp_min(1e-30), torch.full_like(sxl, -1.0))
        better = score > best_score
        best_scale = torch.where(better, sxl / sl2.clamp_min(1e-30), best_scale)
        best_score = torch.where(better, score, best_score)
    return torch.where(zero.squeeze(-1), torch.zeros_like(best_scale), best_scale)


def _super_scale(values: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative sub-block ``values`` ``[n, k]`` as the fp16 bytes of ``d = max / top`` and integer steps
    ``0..top`` of ``d`` (their float32 ``d`` returned for the rounding of the codes)."""
    d = _fp16_bytes(values.amax(dim=-1) / top)
    stored = _fp16(d)
    steps = torch.round(values / torch.where(stored > 0, stored, torch.ones_like(stored))).clamp(0, top)
    return d, torch.where(stored > 0, steps, torch.zeros_like(steps))


def _signed_super_scale(scales: torch.Tensor, low: int, high: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed sub-block ``scales`` ``[n, k]`` as fp16 ``d`` bytes and integer steps ``low..high`` (the largest
    magnitude at ``low``, as llama.cpp)."""
    index = scales.abs().argmax(dim=-1, keepdim=True)
    peak = scales.gather(-1, index)
    d = _fp16_bytes((peak / low).squeeze(-1))
    stored = _fp16(d)
    steps = torch.round(scales / torch.where(stored != 0, stored, torch.ones_like(stored))).clamp(low, high)
    return d, torch.where(stored != 0, steps, torch.zeros_like(steps))


# ---- the formats' pieces ----------------------------------------------------------------------------------------
def _affine(levels: int) -> tuple[Callable, Callable]:
    """Rounding to codes ``0..levels`` and the values ``step·q - offset`` (code 0 where the step is 0)."""

    def codes(x: torch.Tensor, step: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        safe = torch.where(step > 0, step, torch.ones_like(step))
        rounded = torch.round((x + offset) / safe).clamp(0, levels)
        return torch.where(step > 0, rounded, torch.zeros_like(rounded)).to(torch.uint8)

    def values(q: torch.Tensor, step: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        return step * q.float() - offset

    return codes, values


def _signed(low: int, high: int, zero: int | None = None) -> tuple[Callable, Callable]:
    """Rounding of ``x ≈ step·k``, ``k`` in ``low..high`` (0 where the step is 0), to codes ``k + zero`` (default
    ``-low``), and the values ``step·(code - zero)``."""
    zero = -low if zero is None else zero

    def codes(x: torch.Tensor, step: torch.Tensor, offset: None = None) -> torch.Tensor:
        safe = torch.where(step != 0, step, torch.ones_like(step))
        rounded = torch.round(x / safe).clamp(low, high)
        return (torch.where(step != 0, rounded, torch.zeros_like(rounded)) + zero).to(torch.uint8)

    def values(q: torch.Tensor, step: torch.Tensor, offset: None = None) -> torch.Tensor:
        return step * (q.float() - zero)

    return codes, values


def _d_only(fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, None]:
    return _fp16(fields["d"]), None


def _fit_symmetric_block(nmax: int) -> Callable:
    """A 32-weight block's fp16 ``d`` (Q4_0, Q5_0)."""

    def fit(x: torch.Tensor, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, None]:
        d = _fp16_bytes(_fit_symmetric(x, w, nmax))
        return {"d": d}, _fp16(d), None

    return fit


# ---- Q4_K / Q5_K: 8 sub-blocks of 32, 6-bit scales and mins ---------------------------------------------------
def _pack_scale_min(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    first = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    second = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return torch.cat([first, second, third], dim=1)


def _unpack_scale_min(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, m, md = raw[:, :4], raw[:, 4:8], raw[:, 8:]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _fit_k_affine(bits: int) -> Callable:
    def fit(x: torch.Tensor, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        scale, minimum = _fit_affine(x.reshape(n, 8, 32), w.reshape(n, 8, 32), (1 << bits) - 1)
        d, sc = _super_scale(scale, 63)
        dmin, m = _super_scale(minimum, 63)
        return {"d": d, "dmin": dmin, "scales": _pack_scale_min(sc, m)}, _fp16(d) * sc, _fp16(dmin) * m

    return fit


def _k_affine_grid(fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    sc, m = _unpack_scale_min(fields["scales"])
    return _fp16(fields["d"]) * sc, _fp16(fields["dmin"]) * m


def _low_nibbles_64(q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K ``qs``: per 64 weights, 32 bytes holding weight ``k`` (low) and ``k + 32`` (high)."""
    grouped = q.reshape(q.shape[0], 4, 2, 32)
    return _nibbles(grouped[:, :, 0], grouped[:, :, 1]).reshape(q.shape[0], 128)


def _from_low_nibbles_64(raw: torch.Tensor) -> torch.Tensor:
    grouped = raw.reshape(raw.shape[0], 4, 1, 32)
    return torch.cat([grouped & 15, grouped >> 4], dim=2).reshape(raw.shape[0], 256)


def _pack_q4_k(q):
    return {"qs": _low_nibbles_64(q)}


def _unpack_q4_k(fields):
    return _from_low_nibbles_64(fields["qs"])


def _pack_q5_k(q):
    return {"qh": _bit_planes((q >> 4).reshape(q.shape[0], 8, 32), 8), "qs": _low_nibbles_64(q & 15)}


def _unpack_q5_k(fields):
    return _from_low_nibbles_64(fields["qs"]) | (_planes(fields["qh"], 8).reshape(-1, 256) << 4)


# ---- Q2_K: 16 sub-blocks of 16, 4-bit scales and mins -----------------------------------------------------------
def _quarters_128(q: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K ``qs``: per 128 weights, 32 bytes; bits ``2s`` of byte ``k`` hold weight ``32s + k``."""
    n = q.shape[0]
    return torch.cat([_bit_planes(q[:, 128 * h : 128 * (h + 1)].reshape(n, 4, 32), 4) for h in range(2)], dim=1)


def _from_quarters_128(raw: torch.Tensor) -> torch.Tensor:
    n = raw.shape[0]
    return torch.cat([_planes(raw[:, 32 * h : 32 * (h + 1)], 4).reshape(n, 128) for h in range(2)], dim=1)


def _fit_q2_k(x, w):
    n = x.shape[0]
    scale, minimum = _fit_affine(x.reshape(n, 16, 16), w.reshape(n, 16, 16), 3)
    d, sc = _super_scale(scale, 15)
    dmin, m = _super_scale(minimum, 15)
    return {"scales": _nibbles(sc, m), "d": d, "dmin": dmin}, _fp16(d) * sc, _fp16(dmin) * m


def _q2_k_grid(fields):
    raw = fields["scales"]
    return _fp16(fields["d"]) * (raw & 15).float(), _fp16(fields["dmin"]) * (raw >> 4).float()


def _pack_q2_k(q):
    return {"qs": _quarters_128(q)}


def _unpack_q2_k(fields):
    return _from_quarters_128(fields["qs"])


# ---- Q3_K: 16 sub-blocks of 16, signed 6-bit scales, codes -4..3 -----------------------------------------------
def _pack_q3_scales(steps: torch.Tensor) -> torch.Tensor:
    """Signed steps ``-32..31`` ``[n, 16]`` → 12 bytes: low nibbles of scale ``i`` in byte ``i % 8`` (high half for
    ``i >= 8``), the top two bits of scale ``i`` at bits ``2·(i // 4)`` of byte ``8 + i % 4``."""
    u = (steps + 32).to(torch.uint8)
    low = _nibbles(u[:, :8], u[:, 8:])
    high = _bit_planes((u >> 4).reshape(u.shape[0], 4, 4), 4)
    return torch.cat([low, high], dim=1)


def _unpack_q3_scales(raw: torch.Tensor) -> torch.Tensor:
    low = torch.cat([raw[:, :8] & 15, raw[:, :8] >> 4], dim=1)
    high = _planes(raw[:, 8:], 4).reshape(raw.shape[0], 16)
    return ((low | (high << 4)).to(torch.int8) - 32).float()


def _fit_q3_k(x, w):
    n = x.shape[0]
    d, steps = _signed_super_scale(_fit_symmetric(x.reshape(n, 16, 16), w.reshape(n, 16, 16), 4), -32, 31)
    return {"scales": _pack_q3_scales(steps), "d": d}, _fp16(d) * steps, None


def _q3_k_grid(fields):
    return _fp16(fields["d"]) * _unpack_q3_scales(fields["scales"]), None


def _pack_q3_k(q):
    """Codes ``0..7`` (``k + 4``): the low two bits in ``qs``, the third in ``hmask``."""
    return {"hmask": _bit_planes((q >> 2).reshape(q.shape[0], 8, 32), 8), "qs": _quarters_128(q & 3)}


def _unpack_q3_k(fields):
    return _from_quarters_128(fields["qs"]) | (_planes(fields["hmask"], 8).reshape(-1, 256) << 2)


# ---- Q6_K: 16 sub-blocks of 16, int8 scales, codes -32..31 ------------------------------------------------------
def _fit_q6_k(x, w):
    n = x.shape[0]
    d, steps = _signed_super_scale(_fit_symmetric(x.reshape(n, 16, 16), w.reshape(n, 16, 16), 32), -128, 127)
    return {"scales": steps.to(torch.int8).view(torch.uint8), "d": d}, _fp16(d) * steps, None


def _q6_k_grid(fields):
    return _fp16(fields["d"]) * fields["scales"].view(torch.int8).float(), None


def _pack_q6_k(q):
    n = q.shape[0]
    q = q.reshape(n, 2, 2, 64)
    ql = _nibbles(q[:, :, 0], q[:, :, 1]).reshape(n, 128)
    qh = torch.cat([_bit_planes((q[:, h].reshape(n, 4, 32) >> 4), 4) for h in range(2)], dim=1)
    return {"ql": ql, "qh": qh}


def _unpack_q6_k(fields):
    n = fields["ql"].shape[0]
    ql = fields["ql"].reshape(n, 2, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], dim=2).reshape(n, 2, 128)
    high = torch.stack([_planes(fields["qh"][:, 32 * h : 32 * (h + 1)], 4).reshape(n, 128) for h in range(2)], 1)
    return (low | (high << 4)).reshape(n, 256)


# ---- 32-weight fallbacks ----------------------------------------------------------------------------------------
def _halves_32(q: torch.Tensor) -> torch.Tensor:
    return _nibbles(q[:, :16], q[:, 16:])


def _from_halves_32(raw: torch.Tensor) -> torch.Tensor:
    return torch.cat([raw & 15, raw >> 4], dim=1)


def _qh_32(bits: torch.Tensor) -> torch.Tensor:
    """Bit ``j`` of a little-endian uint32 for weight ``j``."""
    return _bit_planes(bits.reshape(bits.shape[0], 4, 8).transpose(1, 2), 8)


def _from_qh_32(raw: torch.Tensor) -> torch.Tensor:
    return _planes(raw, 8).transpose(1, 2).reshape(raw.shape[0], 32)


def _pack_nibbles_32(q):
    return {"qs": _halves_32(q)}


def _unpack_nibbles_32(fields):
    return _from_halves_32(fields["qs"])


def _pack_five_bits_32(q):
    return {"qh": _qh_32(q >> 4), "qs": _halves_32(q)}


def _unpack_five_bits_32(fields):
    return _from_halves_32(fields["qs"]) | (_from_qh_32(fields["qh"]) << 4)


def _fit_q5_1(x, w):
    scale, minimum = _fit_affine(x, w, 31)
    d, m = _fp16_bytes(scale), _fp16_bytes(-minimum)
    return {"d": d, "m": m}, _fp16(d), -_fp16(m)


def _q5_1_grid(fields):
    return _fp16(fields["d"]), -_fp16(fields["m"])


def _fit_q8_0(x, w):
    d = _fp16_bytes(x.abs().amax(dim=-1) / 127)
    return {"d": d}, _fp16(d), None


def _pack_q8_0(q):
    """Codes ``k + 128`` → GGML's int8 ``k`` (flipping the top bit is the two's complement)."""
    return {"qs": q ^ 128}


def _unpack_q8_0(fields):
    return fields["qs"] ^ 128


_IQ4 = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)


def _fit_iq4_nl(x, w):
    """Per block, ``d`` from the weighted least squares of the nearest table entries over candidate ``d``s."""
    index = x.abs().argmax(dim=-1, keepdim=True)
    peak = x.gather(-1, index)
    best_d = peak / _IQ4[0]
    best_score = torch.full_like(best_d, -1.0)
    for step in range(-7, 8):
        d = peak / (_IQ4[0] + 0.5 * step)
        values = _IQ4.to(x.device)[_nearest_iq4(x, d)]
        sxl, sl2 = (w * x * values).sum(-1, keepdim=True), (w * values * values).sum(-1, keepdim=True)
        score = sxl * sxl / sl2.clamp_min(1e-30)
        better = score > best_score
        best_d = torch.where(better, sxl / sl2.clamp_min(1e-30), best_d)
        best_score = torch.where(better, score, best_score)
    d = _fp16_bytes(best_d.squeeze(-1))
    return {"d": d}, _fp16(d), None


def _nearest_iq4(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    safe = torch.where(d != 0, d, torch.ones_like(d))
    return ((x / safe).unsqueeze(-1) - _IQ4.to(x.device)).abs().argmin(dim=-1)


def _iq4_codes(x: torch.Tensor, step: torch.Tensor, offset: None = None) -> torch.Tensor:
    return _nearest_iq4(x, step).to(torch.uint8)


def _iq4_values(q: torch.Tensor, step: torch.Tensor, offset: None = None) -> torch.Tensor:
    return step * _IQ4.to(step.device)[q.long()]


_K_AFFINE_SCALES = (("d", 2, "s"), ("dmin", 2, "s"), ("scales", 12, "s"))
FORMATS = {
    f.name: f
    for f in (
        BlockFormat(
            "Q2_K",
            QK_K,
            16,
            (("scales", 16, "s"), ("qs", 64, "q"), ("d", 2, "s"), ("dmin", 2, "s")),
            _fit_q2_k,
            _q2_k_grid,
            *_affine(3),
            _pack_q2_k,
            _unpack_q2_k,
        ),
        BlockFormat(
            "Q3_K",
            QK_K,
            16,
            (("hmask", 32, "q"), ("qs", 64, "q"), ("scales", 12, "s"), ("d", 2, "s")),
            _fit_q3_k,
            _q3_k_grid,
            *_signed(-4, 3),
            _pack_q3_k,
            _unpack_q3_k,
        ),
        BlockFormat(
            "Q4_K",
            QK_K,
            32,
            (*_K_AFFINE_SCALES, ("qs", 128, "q")),
            _fit_k_affine(4),
            _k_affine_grid,
            *_affine(15),
            _pack_q4_k,
            _unpack_q4_k,
        ),
        BlockFormat(
            "Q5_K",
            QK_K,
            32,
            (*_K_AFFINE_SCALES, ("qh", 32, "q"), ("qs", 128, "q")),
            _fit_k_affine(5),
            _k_affine_grid,
            *_affine(31),
            _pack_q5_k,
            _unpack_q5_k,
        ),
        BlockFormat(
            "Q6_K",
            QK_K,
            16,
            (("ql", 128, "q"), ("qh", 64, "q"), ("scales", 16, "s"), ("d", 2, "s")),
            _fit_q6_k,
            _q6_k_grid,
            *_signed(-32, 31),
            _pack_q6_k,
            _unpack_q6_k,
        ),
        BlockFormat(
            "Q4_0",
            32,
            32,
            (("d", 2, "s"), ("qs", 16, "q")),
            _fit_symmetric_block(8),
            _d_only,
            *_signed(-8, 7),
            _pack_nibbles_32,
            _unpack_nibbles_32,
        ),
        BlockFormat(
            "Q5_0",
            32,
            32,
            (("d", 2, "s"), ("qh", 4, "q"), ("qs", 16, "q")),
            _fit_symmetric_block(16),
            _d_only,
            *_signed(-16, 15),
            _pack_five_bits_32,
            _unpack_five_bits_32,
        ),
        BlockFormat(
            "Q5_1",
            32,
            32,
            (("d", 2, "s"), ("m", 2, "s"), ("qh", 4, "q"), ("qs", 16, "q")),
            _fit_q5_1,
            _q5_1_grid,
            *_affine(31),
            _pack_five_bits_32,
            _unpack_five_bits_32,
        ),
        BlockFormat(
            "Q8_0",
            32,
            32,
            (("d", 2, "s"), ("qs", 32, "q")),
            _fit_q8_0,
            _d_only,
            *_signed(-127, 127, 128),
            _pack_q8_0,
            _unpack_q8_0,
        ),
        BlockFormat(
            "IQ4_NL",
            32,
            32,
            (("d", 2, "s"), ("qs", 16, "q")),
            _fit_iq4_nl,
            _d_only,
            _iq4_codes,
            _iq4_values,
            _pack_nibbles_32,
            _unpack_nibbles_32,
        ),
    )
}


def join(fmt: BlockFormat, fields: dict[str, torch.Tensor], part: str) -> torch.Tensor:
    """The fields of one part (``q`` or ``s``) ``[n, bytes]`` side by side in GGML's order."""
    return torch.cat([fields[name] for name, _, kind in fmt.fields if kind == part], dim=1)


def split(fmt: BlockFormat, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks' fields ``[n, bytes]`` → (quants ``[n, q bytes]``, scales ``[n, s bytes]``), each in GGML's order."""
    parts = {part: [fields[name] for name, _, kind in fmt.fields if kind == part] for part in "qs"}
    return torch.cat(parts["q"], dim=1), torch.cat(parts["s"], dim=1)


def fields_of(fmt: BlockFormat, quants: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    out, offsets = {}, {"q": 0, "s": 0}
    source = {"q": quants, "s": scales}
    for name, size, part in fmt.fields:
        out[name] = source[part][:, offsets[part] : offsets[part] + size]
        offsets[part] += size
    return out


def ggml_bytes(fmt: BlockFormat, quants: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Whole GGML blocks ``[n, block bytes]`` (as written into GGUF) from our two parts."""
    fields = fields_of(fmt, quants, scales)
    return torch.cat([fields[name] for name, _, _ in fmt.fields], dim=1)
