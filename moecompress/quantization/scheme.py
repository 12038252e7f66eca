"""Weight quantisation schemes and the quantised tensor they produce.

A :class:`QuantScheme` quantises along the last (input) dimension of a weight ``[..., rows, cols]``. It exposes
the three steps separately (fit a grid per group, round values onto it, pack codes) so that GPTQ can fit each
group's grid to weights it has already corrected; plain round-to-nearest runs them once over the whole tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ..kernels import mxfp4
from ..kernels.packing import pack_codes, unpack_codes
from ..registry import RegisteredNames
from .salient import BITMAP_CODES, BitmapCode, SalientWeights, encode_positions, from_mask
from .schemes import SCHEME_KINDS, Grid, SchemeKind, kind_of

SchemeName = str
SCHEMES: Sequence[str] = RegisteredNames(SCHEME_KINDS)
"""The registered scheme names (:mod:`moecompress.quantization.schemes`), read on each use."""
MAX_SALIENT_FRACTION = 0.5

CHUNK_ELEMENTS = 1 << 18


def default_group_size(name: str) -> int:
    return kind_of(name).default_group_size


@dataclass(frozen=True)
class QuantScheme:
    """The settings of one weight scheme; its registered :class:`~moecompress.quantization.schemes.SchemeKind`
    (:attr:`kind`) decides everything else. ``group_size`` is fixed at 32 for MXFP4; ``symmetric`` applies to the
    integer schemes; ``scale_rule`` to MXFP4. ``salient_fraction`` of each expert matrix's weights (chosen from
    calibration) are kept exactly in bf16 beside the low-bit codes, their positions in a bitmap coded as ``bitmap``
    says."""

    name: SchemeName
    group_size: int = 32
    symmetric: bool = True
    scale_rule: mxfp4.ScaleRule = "floor"
    salient_fraction: float = 0.0
    bitmap: BitmapCode = "rice"

    def __post_init__(self) -> None:
        self.kind.check(self)
        if self.scale_rule not in mxfp4.SCALE_RULES:
            raise ValueError(f"unknown scale rule {self.scale_rule!r}; choose from {mxfp4.SCALE_RULES}")
        if not 0 <= self.salient_fraction <= MAX_SALIENT_FRACTION:
            raise ValueError(f"salient fraction must be in [0, {MAX_SALIENT_FRACTION}], got {self.salient_fraction}")
        if self.bitmap not in BITMAP_CODES:
            raise ValueError(f"unknown bitmap code {self.bitmap!r}; choose from {BITMAP_CODES}")

    @property
    def kind(self) -> SchemeKind:
        return kind_of(self.name)

    @property
    def bits(self) -> int:
        return self.kind.bits

    @property
    def activation_bits(self) -> int | None:
        """Bits of the per-token activation quantisation at inference (W4A8), else None."""
        return self.kind.activation_bits

    @property
    def stores_zeros(self) -> bool:
        """Whether a zero point is stored per group."""
        return self.kind.stores_zeros(self)

    @property
    def is_float(self) -> bool:
        """Kept for callers outside moecompress; moecompress asks :attr:`kind` instead."""
        return self.kind.number_type == "float"

    @property
    def is_binary(self) -> bool:
        """Kept for callers outside moecompress; moecompress asks :attr:`kind` instead."""
        return self.kind.bits == 1

    def logical_cols(self, packed_cols: int, scales_cols: int | None = None) -> int:
        """The input dimension of a weight whose packed codes are ``packed_cols`` bytes per row."""
        return self.kind.logical_cols(self, packed_cols, scales_cols)

    def width_problem(self, cols: int) -> str | None:
        """Why a weight with ``cols`` inputs cannot be quantised in this scheme, or None."""
        return self.kind.width_problem(self, cols)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.salient_fraction:
            del data["salient_fraction"], data["bitmap"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantScheme:
        fields = ("name", "group_size", "symmetric", "scale_rule", "salient_fraction", "bitmap")
        return cls(**{key: data[key] for key in fields if key in data})

    def describe(self) -> str:
        text = self.kind.describe(self)
        if self.salient_fraction:
            text += f", {self.salient_fraction:.2%} salient weights in bf16, {self.bitmap} bitmap"
        return text + ")"

    # ---- the three steps ----------------------------------------------------------------------------------
    def fit(self, groups: torch.Tensor, exclude: torch.Tensor | None = None) -> Grid:
        """The grid of each group in ``groups`` ``[..., n, G]``, fitted without the weights ``exclude`` marks
        (salient weights, kept exactly)."""
        return self.kind.fit(self, groups, exclude)

    def codes(self, values: torch.Tensor, grid: Grid) -> torch.Tensor:
        """uint8 codes of ``values`` (broadcast against ``grid``)."""
        return self.kind.codes(self, values, grid)

    def values(self, codes: torch.Tensor, grid: Grid) -> torch.Tensor:
        """float32 values of ``codes`` on ``grid``."""
        return self.kind.values(self, codes, grid)

    def pack(self, codes: torch.Tensor, grid: Grid, salient: SalientWeights | None = None) -> QuantizedTensor:
        """A :class:`QuantizedTensor` from codes ``[..., cols]`` and the grid of their groups ``[..., n, 1]``."""
        scales, zeros = self.kind.pack_grid(self, grid)
        return QuantizedTensor(self, tuple(codes.shape), pack_codes(codes, self.bits), scales, zeros, salient)

    def stack_grids(self, grids: list[Grid]) -> Grid:
        """Per-group grids ``[..., 1, 1]`` in column order → one grid ``[..., groups, 1]``."""
        return self.kind.stack_grids(grids)

    def grouped(self, weight: torch.Tensor) -> torch.Tensor:
        if weight.shape[-1] % self.group_size:
            raise ValueError(
                f"{self.name}: the input dimension {weight.shape[-1]} is not a multiple of {self.group_size}"
            )
        return weight.reshape(*weight.shape[:-1], -1, self.group_size)

    def quantize(
        self,
        weight: torch.Tensor,
        keep: torch.Tensor | None = None,
        chunk_elements: int = CHUNK_ELEMENTS,
        importance: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """Round-to-nearest quantisation of ``weight`` ``[..., cols]``; the weights ``keep`` marks (bool, same
        shape) are left out of the grids and stored exactly as salient weights.

        MXFP4 uses the fused numba kernel when numba is installed (bit-identical, about 20x faster). Otherwise
        rows are processed ``chunk_elements`` at a time so every intermediate stays in cache (about twice as fast
        as whole-tensor passes on CPU); the result does not depend on the chunking.
        """
        whole = self._quantize_whole(weight, keep, importance)
        if whole is not None:
            return whole
        fast = None if keep is not None else self.kind.quantize_fast(self, weight)
        if fast is not None:
            return QuantizedTensor(self, tuple(weight.shape), *fast)
        cols = weight.shape[-1]
        rows = weight.reshape(-1, cols)
        kept_rows = None if keep is None else keep.reshape(-1, cols)
        step = max(1, chunk_elements // cols)
        parts = []
        for start in range(0, rows.shape[0], step):
            groups = self.grouped(rows[start : start + step].float())
            exclude = None if kept_rows is None else self.grouped(kept_rows[start : start + step])
            grid = self.fit(groups, exclude)
            parts.append(self.pack(self.codes(groups, grid).reshape(-1, cols), grid))
        packed = torch.cat([p.packed for p in parts]).reshape(*weight.shape[:-1], -1)
        scales = torch.cat([p.scales for p in parts]).reshape(*weight.shape[:-1], -1)
        zeros = None if parts[0].zeros is None else torch.cat([p.zeros for p in parts]).reshape(scales.shape)
        salient = None if keep is None else from_mask(keep, weight)
        return QuantizedTensor(self, tuple(weight.shape), packed, scales, zeros, salient)

    def _quantize_whole(
        self, weight: torch.Tensor, keep: torch.Tensor | None, importance: torch.Tensor | None
    ) -> QuantizedTensor | None:
        """A scheme with its own layout (k-quants): ``importance`` per input column ``[..., 1, cols]`` weights the
        rounding error; salient weights get no weight in the fit."""
        if keep is not None:
            base = torch.ones_like(weight, dtype=torch.float32) if importance is None else importance.float()
            importance = torch.where(keep, torch.zeros((), dtype=torch.float32), base.expand(weight.shape))
        stored = self.kind.quantize(self, weight, importance)
        if stored is None:
            return None
        salient = None if keep is None else from_mask(keep, weight)
        return QuantizedTensor(self, tuple(weight.shape), *stored, salient)


@dataclass
class QuantizedTensor:
    """A weight in a :class:`QuantScheme`: packed codes, per-group scales, (asymmetric) zero points and the
    salient weights kept exactly.

    ``shape`` is the logical (dequantised) shape; all stored tensors share its leading dimensions.
    """

    scheme: QuantScheme
    shape: tuple[int, ...]
    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    salient: SalientWeights | None = None

    STORED_SUFFIXES = ("", "_scales", "_zeros", "_salient", "_salient_values")

    def codes(self) -> torch.Tensor:
        return unpack_codes(self.packed, self.scheme.bits)

    def grid(self) -> Grid:
        return self.scheme.kind.unpack_grid(self.scheme, self.scales, self.zeros)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in ``dtype``. On CPU one numba pass writes ``dtype`` directly
        (:mod:`moecompress.kernels.dequant`, bit-identical to :meth:`_dequantize_reference`); other devices and
        layouts the kernels do not read take the reference. Salient weights are written by the same pass, each
        row's as soon as the row is decoded."""
        dense = self._dequantize_fast(dtype)
        return self._dequantize_reference(dtype) if dense is None else dense

    def _dequantize_fast(self, dtype: torch.dtype) -> torch.Tensor | None:
        salient = None if self.salient is None else (self.salient.positions, self.salient.values)
        return self.scheme.kind.dequantize_fast(self, dtype, salient)

    def _dequantize_reference(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The definition (torch, any device): unpack the codes, compute float32 values, convert to ``dtype``."""
        dense = self.scheme.kind.dequantize(self, dtype)
        if dense is None:
            codes = self.scheme.grouped(self.codes())
            dense = self.scheme.values(codes, self.grid()).to(dtype).reshape(self.shape)
        return dense if self.salient is None else self.salient.apply(dense)

    def stored(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors to write for a weight named ``name``: the packed codes take the weight's own name; salient
        weights add ``<name>_salient`` (the coded bitmap) and ``<name>_salient_values``."""
        out = {name: self.packed, f"{name}_scales": self.scales}
        if self.zeros is not None:
            out[f"{name}_zeros"] = self.zeros
        if self.salient is not None:
            out[f"{name}_salient"] = encode_positions(self.salient.positions, self.numel, self.scheme.bitmap)
            out[f"{name}_salient_values"] = self.salient.values
        return out

    @property
    def nbytes(self) -> int:
        """Bytes as stored (the salient bitmap in its coded form)."""
        return sum(t.numel() * t.element_size() for t in self.stored("w").values())

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def _expert_size(self) -> int:
        return self.numel // self.shape[0]

    def select(self, index: torch.Tensor) -> QuantizedTensor:
        """Rows ``index`` of the leading dimension (experts)."""

        def pick(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.index_select(0, index).contiguous()

        salient = self.salient
        if salient is not None:
            salient = salient.of_experts([int(i) for i in index.tolist()], self._expert_size)
        return replace(
            self,
            shape=(len(index), *self.shape[1:]),
            packed=pick(self.packed),
            scales=pick(self.scales),
            zeros=pick(self.zeros),
            salient=salient,
        )

    def take_rows(self, index: torch.Tensor) -> QuantizedTensor:
        """Rows ``index`` of the second-to-last (output) dimension, e.g. the gate half of a fused gate_up."""

        if self.salient is not None:
            raise ValueError("a weight with salient weights cannot be split by rows (only the native format holds it)")

        def pick(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.index_select(-2, index).contiguous()

        return replace(
            self,
            shape=(*self.shape[:-2], len(index), self.shape[-1]),
            packed=pick(self.packed),
            scales=pick(self.scales),
            zeros=pick(self.zeros),
        )

    def __getitem__(self, expert: int) -> QuantizedTensor:
        return replace(
            self,
            shape=self.shape[1:],
            packed=self.packed[expert],
            scales=self.scales[expert],
            zeros=None if self.zeros is None else self.zeros[expert],
            salient=None if self.salient is None else self.salient.of_expert(expert, self._expert_size),
        )
