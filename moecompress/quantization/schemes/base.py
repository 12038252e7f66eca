"""What a weight scheme is: a :class:`SchemeKind` subclass registered under its name, holding every decision that
depends on the scheme (value grid, packing, group sizes, rounding, dequantisation, the formats and kernels it
has). :class:`~moecompress.quantization.scheme.QuantScheme` is its settings (group size, symmetry, ...) and asks
it; nothing outside the scheme modules tests a scheme's name.

Adding a scheme is one module with a :func:`register`-decorated subclass and one import line in
:mod:`moecompress.quantization.schemes`; a scheme defined elsewhere (a test, a user's script) registers the same
way before it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ...registry import Registry

if TYPE_CHECKING:
    from ..scheme import QuantizedTensor, QuantScheme

Grid = Any
"""Per-group grid as :meth:`SchemeKind.fit` returns it (a tensor or a small dataclass of tensors)."""

SCHEME_KINDS: Registry[SchemeKind] = Registry("scheme")


class SchemeKind:
    """The behaviour of one scheme. The defaults describe a "codes on a per-group grid" scheme: codes of ``bits``
    bits packed along the row, one grid per ``group_size`` weights; a scheme with another layout overrides
    :meth:`quantize` and :meth:`dequantize` (and the stored shapes)."""

    name: ClassVar[str]
    bits: ClassVar[int]
    activation_bits: ClassVar[int | None] = None
    """Bits of the per-token activation quantisation at inference (W4A8), else None."""
    group_sizes: ClassVar[tuple[int, ...]] = (32, 64, 128)
    default_group_size: ClassVar[int] = 32
    fixed_group_size: ClassVar[int | None] = None
    """Set where the format has one block width (MXFP4's 32): the group size option is refused otherwise."""
    default_symmetric: ClassVar[bool] = True
    settings: ClassVar[frozenset[str]] = frozenset()
    """The QuantizeConfig fields beyond the group size this scheme reads (``symmetric``, ``scale_rule``)."""
    scale_dtype: ClassVar[torch.dtype] = torch.bfloat16
    label: ClassVar[str] = ""
    """How the values are described where a format refuses them ("sign-bit (binary)")."""
    formats: ClassVar[frozenset[str]] = frozenset({"native"})
    """The output formats that hold this scheme's weights exactly."""
    compressed_tensors_format: ClassVar[str | None] = None
    number_type: ClassVar[str] = "int"
    """compressed-tensors' ``type`` of the weights (``int`` or ``float``)."""
    cpu_matmul: ClassVar[str | None] = None
    """The CPU matmul family (:mod:`moecompress.quantization.cpu_forward`) that reads these codes, if any."""
    triton_moe: ClassVar[bool] = False
    """Whether the fused Triton MoE kernel reads these experts."""
    gptq: ClassVar[bool] = True
    """Whether GPTQ can fit this grid column by column (else calibrated runs use importance-weighted RTN)."""

    # ---- settings --------------------------------------------------------------------------------------------
    def check(self, scheme: QuantScheme) -> None:
        """Raise ``ValueError`` for settings this scheme cannot hold."""
        if self.fixed_group_size is not None and scheme.group_size != self.fixed_group_size:
            raise ValueError(f"{self.name} blocks are {self.fixed_group_size} wide, not {scheme.group_size}")
        if self.fixed_group_size is None and scheme.group_size not in self.group_sizes:
            raise ValueError(f"{self.name} group size must be one of {self.group_sizes}, got {scheme.group_size}")

    def stores_zeros(self, scheme: QuantScheme) -> bool:
        return False

    def describe(self, scheme: QuantScheme) -> str:
        return f"{self.name} (group {scheme.group_size}"

    # ---- the three steps of a grid scheme --------------------------------------------------------------------
    def fit(self, scheme: QuantScheme, groups: torch.Tensor, exclude: torch.Tensor | None) -> Grid:
        raise NotImplementedError

    def codes(self, scheme: QuantScheme, values: torch.Tensor, grid: Grid) -> torch.Tensor:
        raise NotImplementedError

    def values(self, scheme: QuantScheme, codes: torch.Tensor, grid: Grid) -> torch.Tensor:
        raise NotImplementedError

    def pack_grid(self, scheme: QuantScheme, grid: Grid) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stored scales and zero points (or None) of ``grid`` ``[..., n, 1]``."""
        return grid.squeeze(-1).to(self.scale_dtype), None

    def unpack_grid(self, scheme: QuantScheme, scales: torch.Tensor, zeros: torch.Tensor | None) -> Grid:
        return scales.float().unsqueeze(-1)

    def stack_grids(self, grids: list[Grid]) -> Grid:
        """Per-group grids ``[..., 1, 1]`` in column order → one grid ``[..., groups, 1]`` (GPTQ)."""
        return torch.cat(grids, dim=-2)

    # ---- GPTQ's sweep (:func:`~moecompress.quantization.gptq.gptq_quantize`) -----------------------------------
    def gptq_width(self, scheme: QuantScheme, cols: int) -> int:
        """The columns that share one grid, fitted when GPTQ's sweep reaches the first of them."""
        return scheme.group_size

    def gptq_fit(
        self, scheme: QuantScheme, block: torch.Tensor, exclude: torch.Tensor | None, importance: torch.Tensor
    ) -> Grid:
        """The grid of ``block`` ``[..., rows, width]`` (the weights as corrected so far) without the weights
        ``exclude`` marks; ``importance`` ``[..., 1, width]`` (the Hessian diagonal) is for grids fitted by a
        weighted error."""
        return scheme.fit(block.unsqueeze(-2), None if exclude is None else exclude.unsqueeze(-2))

    def gptq_round(
        self, scheme: QuantScheme, column: torch.Tensor, grid: Grid, index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 codes and float32 values of ``column`` ``[..., rows]``, column ``index`` of ``grid``'s block."""
        codes = scheme.codes(column[..., None, None], grid)
        return codes.reshape(column.shape), scheme.values(codes, grid).reshape(column.shape)

    def gptq_pack(
        self, scheme: QuantScheme, codes: torch.Tensor, grids: list[Grid]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(packed, scales, zeros) of GPTQ's ``codes`` ``[..., cols]`` and its grids in column order; None: codes
        on a grid, packed by :meth:`QuantScheme.pack`."""
        return None

    # ---- whole tensors ---------------------------------------------------------------------------------------
    def quantize_fast(self, scheme: QuantScheme, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(packed, scales) by a fused kernel, bit-identical to the three steps; None where there is none."""
        return None

    def quantize(
        self, scheme: QuantScheme, weight: torch.Tensor, importance: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(packed, scales, zeros) of ``weight`` for a scheme whose layout is not codes on a per-group grid
        (``importance``: per-column weights of the rounding error); None: use the three steps."""
        return None

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The reference dequantisation of a scheme :meth:`quantize` overrides; None: use the three steps."""
        return None

    def dequantize_fast(
        self, q: QuantizedTensor, dtype: torch.dtype, salient: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor | None:
        """A kernel's dequantisation (bit-identical to the reference), or None to take the reference."""
        return None

    def stored_shapes(
        self, scheme: QuantScheme, shape: tuple[int, ...]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Suffix → (shape, dtype) of each tensor stored for a ``shape`` weight (``""`` the packed codes)."""
        *lead, cols = shape
        groups = cols // scheme.group_size
        out = {"": ((*lead, cols * self.bits // 8), torch.uint8), "_scales": ((*lead, groups), self.scale_dtype)}
        if self.stores_zeros(scheme):
            out["_zeros"] = ((*lead, groups), torch.uint8)
        return out

    def logical_cols(self, scheme: QuantScheme, packed_cols: int, scales_cols: int | None = None) -> int:
        """The input dimension of a weight stored as ``packed_cols`` bytes (and ``scales_cols`` scales) per row."""
        return packed_cols * 8 // self.bits

    def width_problem(self, scheme: QuantScheme, cols: int) -> str | None:
        """Why a weight with ``cols`` inputs cannot be held, or None."""
        if cols % scheme.group_size:
            return f"the input dimension {cols} is not a multiple of the group size {scheme.group_size}"
        return None

    # ---- kernels and formats ---------------------------------------------------------------------------------
    def triton_linear(self, module: Any, x: torch.Tensor, bias: torch.Tensor | None, salient: bool) -> Any:
        """``QuantizedLinear``'s forward through a Triton kernel (bf16 on CUDA), or None."""
        return None

    def ggml_type(self, scheme: QuantScheme, has_zeros: bool) -> str | None:
        """The GGML block type holding this scheme's codes and grids, or None."""
        return None

    def ggml_quants(self, scheme: QuantScheme, codes: torch.Tensor, type_name: str) -> torch.Tensor:
        """GGML's 4-bit quants of our ``codes`` in a ``type_name`` block."""
        return codes

    ggml_own_blocks: ClassVar[bool] = False
    """Whether the stored tensors are GGML's own block fields (:meth:`ggml_blocks` joins them), not codes on a grid
    that the export re-packs."""

    def ggml_block_type(self, scheme: QuantScheme, has_zeros: bool, cols: int) -> str | None:
        """The GGML block type of a weight with ``cols`` inputs, or None (default: :meth:`ggml_type` at any width)."""
        return self.ggml_type(scheme, has_zeros)

    def ggml_blocks(self, q: QuantizedTensor) -> tuple[str, torch.Tensor]:
        """The GGML type name and the blocks ``[..., rows, block bytes · blocks]`` as GGUF stores them, for a scheme
        with :attr:`ggml_own_blocks`."""
        raise NotImplementedError


register = SCHEME_KINDS.register
unregister = SCHEME_KINDS.unregister
kind_of = SCHEME_KINDS.lookup
