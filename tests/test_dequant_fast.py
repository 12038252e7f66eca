"""The numba dequantisation (``QuantizedTensor.dequantize`` on CPU) against the torch reference it replaced
(``_dequantize_reference``): the same bits for every scheme, option and output dtype, views included."""

from __future__ import annotations

import pytest
import torch

from moecompress.kernels import dequant
from moecompress.quantization.salient import SalientWeights
from moecompress.quantization.scheme import QuantizedTensor, QuantScheme

SCHEMES = [
    QuantScheme("mxfp4", scale_rule="floor"),
    QuantScheme("mxfp4", scale_rule="ceil"),
    QuantScheme("int4", group_size=32, symmetric=True),
    QuantScheme("int4", group_size=64, symmetric=False),
    QuantScheme("int4", group_size=128, symmetric=True),
    QuantScheme("int2", group_size=32, symmetric=True),
    QuantScheme("int2", group_size=128, symmetric=False),
    QuantScheme("w4a8", group_size=32, symmetric=True),
    QuantScheme("w4a8", group_size=64, symmetric=False),
    QuantScheme("binary", group_size=32),
    QuantScheme("binary", group_size=256),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit patterns; NaNs need only be NaN at the same places (torch itself writes NaN's payload
    differently in its scalar and vector conversions)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.view(BITS[got.element_size()])[~nan], want.view(BITS[want.element_size()])[~nan])


def weights(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=generator) * torch.rand((*shape[:-1], 1), generator=generator) * 0.1
    weight[..., :32] = 0.0  # an all-zero group (scale of 0 or the floor exponent)
    weight[..., 40] = 1e-30  # a block far below the rest
    return weight.to(torch.bfloat16)


@pytest.mark.parametrize("scheme", SCHEMES, ids=QuantScheme.describe)
@pytest.mark.parametrize("seed", [0, 1])
def test_every_scheme_and_dtype_matches_the_reference(scheme: QuantScheme, seed: int) -> None:
    q = scheme.quantize(weights(seed, (3, 6, 512)))
    for dtype in DTYPES:
        assert q._dequantize_fast(dtype) is not None
        assert_same(q.dequantize(dtype), q._dequantize_reference(dtype))


@pytest.mark.parametrize("scheme", SCHEMES, ids=QuantScheme.describe)
def test_views_match_the_reference(scheme: QuantScheme) -> None:
    q = scheme.quantize(weights(2, (4, 5, 256)))
    for dtype in (torch.float32, torch.bfloat16):
        assert_same(q[2].dequantize(dtype), q[2]._dequantize_reference(dtype))
        picked = q.select(torch.tensor([3, 0, 3]))
        assert_same(picked.dequantize(dtype), picked._dequantize_reference(dtype))
        rows = q.take_rows(torch.tensor([4, 1]))
        assert_same(rows.dequantize(dtype), rows._dequantize_reference(dtype))
        assert_same(q.dequantize(dtype)[1], q[1].dequantize(dtype))


@pytest.mark.parametrize("name", ["binary", "int4", "mxfp4"])
def test_salient_weights_are_written_back(name: str) -> None:
    weight = weights(3, (3, 8, 256))
    keep = torch.rand(weight.shape, generator=torch.Generator().manual_seed(3)) < 0.05
    scheme = QuantScheme(name, group_size=32 if name != "binary" else 64, salient_fraction=0.05)
    q = scheme.quantize(weight, keep)
    assert q.salient is not None and q.salient.count > 0
    for dtype in DTYPES:
        dense = q.dequantize(dtype)
        assert_same(dense, q._dequantize_reference(dtype))
        assert torch.equal(dense[keep], weight[keep].to(dtype))
        assert_same(q[1].dequantize(dtype), q[1]._dequantize_reference(dtype))
        picked = q.select(torch.tensor([2, 1]))
        assert_same(picked.dequantize(dtype), picked._dequantize_reference(dtype))


def random_stored(scheme: QuantScheme, shape: tuple[int, ...], seed: int, zero_limit: int) -> QuantizedTensor:
    """A tensor with random packed bytes and scales of every bit pattern (subnormal, infinite and NaN ones
    included): what a damaged or foreign file could hold."""
    generator = torch.Generator().manual_seed(seed)
    *lead, cols = shape
    groups = cols // scheme.group_size

    def random_bytes(width: int, high: int = 256) -> torch.Tensor:
        return torch.randint(0, high, (*lead, width), generator=generator, dtype=torch.int32).to(torch.uint8)

    packed = random_bytes(cols * scheme.bits // 8)
    if scheme.is_float:
        return QuantizedTensor(scheme, shape, packed, random_bytes(groups))
    scale_bits = torch.randint(-(1 << 15), 1 << 15, (*lead, groups), generator=generator, dtype=torch.int32)
    scales = scale_bits.to(torch.int16).view(torch.bfloat16)
    zeros = None if scheme.symmetric or scheme.is_binary else random_bytes(groups, zero_limit)
    return QuantizedTensor(scheme, shape, packed, scales, zeros)


@pytest.mark.parametrize("scheme", SCHEMES, ids=QuantScheme.describe)
def test_any_stored_bytes_match_the_reference(scheme: QuantScheme) -> None:
    q = random_stored(scheme, (2, 16, 512), seed=4, zero_limit=1 << scheme.bits)
    for dtype in DTYPES:
        assert q._dequantize_fast(dtype) is not None
        assert_same(q.dequantize(dtype), q._dequantize_reference(dtype))


def test_zero_points_beyond_the_code_range_take_the_reference() -> None:
    scheme = QuantScheme("int4", group_size=32, symmetric=False)
    q = random_stored(scheme, (8, 64), seed=5, zero_limit=256)
    assert int(q.zeros.max()) >= 16
    assert q._dequantize_fast(torch.float32) is None
    assert_same(q.dequantize(torch.bfloat16), q._dequantize_reference(torch.bfloat16))


def test_other_layouts_and_dtypes_take_the_reference() -> None:
    q = QuantScheme("int4").quantize(weights(6, (4, 64)))
    assert q._dequantize_fast(torch.int32) is None
    float_scales = QuantizedTensor(q.scheme, q.shape, q.packed, q.scales.float())
    assert float_scales._dequantize_fast(torch.float32) is None
    assert_same(float_scales.dequantize(), float_scales._dequantize_reference())
    short = QuantizedTensor(q.scheme, (4, 96), q.packed, q.scales)
    assert short._dequantize_fast(torch.float32) is None
    with pytest.raises(RuntimeError):
        short.dequantize()


def test_non_contiguous_stored_tensors() -> None:
    q = QuantScheme("mxfp4").quantize(weights(7, (6, 128)))
    strided = QuantizedTensor(q.scheme, (3, 128), q.packed[::2], q.scales[::2])
    assert not strided.packed.is_contiguous()
    assert_same(strided.dequantize(torch.bfloat16), strided._dequantize_reference(torch.bfloat16))


def test_torch_thread_count_is_left_alone() -> None:
    q = QuantScheme("int2").quantize(weights(8, (2, 32, 128)))
    before = torch.get_num_threads()
    q.dequantize(torch.bfloat16)
    assert torch.get_num_threads() == before


def test_output_owns_writable_memory() -> None:
    q = QuantScheme("binary", group_size=64).quantize(weights(9, (2, 4, 128)))
    first, second = q.dequantize(torch.bfloat16), q.dequantize(torch.bfloat16)
    first.zero_()
    assert_same(second, q._dequantize_reference(torch.bfloat16))
    salient = SalientWeights(torch.tensor([0, 5]), torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    dense = salient.apply(q.dequantize(torch.float32))
    assert dense.view(-1)[5] == -2.0
    assert dequant.binary(q.packed, q.scales, 64, q.shape, torch.float64) is not None


def test_binary_every_scale_bit_pattern_matches_the_reference() -> None:
    """All 65,536 bf16 scales (zeros of both signs, subnormals, infinities, NaNs) with random signs: the kernel
    selects between the table's ``-s`` and ``+s`` 32 codes at a time, so each lane must pick its own code's bit."""
    scheme = QuantScheme("binary", group_size=32)
    generator = torch.Generator().manual_seed(10)
    scales = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(2048, 32)
    packed = torch.randint(0, 256, (2048, 128), generator=generator, dtype=torch.int32).to(torch.uint8)
    q = QuantizedTensor(scheme, (2048, 1024), packed, scales)
    for dtype in (*DTYPES, torch.float64):
        assert q._dequantize_fast(dtype) is not None
        assert_same(q.dequantize(dtype), q._dequantize_reference(dtype))


def test_binary_code_bits_land_on_their_own_weights() -> None:
    """One set bit per row, at every position of a 256-weight row: a lane or byte order slip moves the ``+s``."""
    scheme = QuantScheme("binary", group_size=64)
    positions = torch.arange(256)
    codes = torch.zeros(256, 256, dtype=torch.uint8)
    codes[positions, positions] = 1
    packed = (codes.reshape(256, 32, 8) << torch.arange(8, dtype=torch.uint8)).sum(-1).to(torch.uint8)
    scales = torch.full((256, 4), 0.5, dtype=torch.bfloat16)
    dense = QuantizedTensor(scheme, (256, 256), packed, scales).dequantize(torch.bfloat16)
    assert torch.equal(dense, torch.where(codes.bool(), 0.5, -0.5).to(torch.bfloat16))


def test_binary_group_sizes_off_the_lane_width_take_the_reference() -> None:
    q = QuantScheme("binary", group_size=32).quantize(weights(11, (4, 64)))
    assert dequant.binary(q.packed, q.scales.repeat_interleave(2, -1), 16, q.shape, torch.bfloat16) is None


@pytest.fixture
def kernel_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(written by the kernel, salient count)`` of each dequantisation with salient weights."""
    calls: list[tuple[int, int]] = []
    finish = dequant._finish

    def spy(out: torch.Tensor, written: int, salient: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if salient is not None:
            calls.append((written, salient[0].numel()))
        return finish(out, written, salient)

    monkeypatch.setattr(dequant, "_finish", spy)
    return calls


SALIENT_SCHEMES = [
    QuantScheme("mxfp4"),
    QuantScheme("int4", group_size=32, symmetric=False),
    QuantScheme("int2", group_size=64),
    QuantScheme("binary", group_size=64),
]


def edge_salient(rows: int, cols: int) -> SalientWeights:
    """Salient weights at the first and last weight, both ends of most rows, runs of neighbours, rows without any,
    over more rows than one kernel block holds; bf16 values that are NaN, infinite, beyond float16, subnormal, -0."""
    marks = torch.zeros(rows, cols, dtype=torch.bool)
    marks[::2, 0] = marks[::3, -1] = True
    marks[5, 10:40] = marks[rows - 1, -8:] = marks[0, 0] = True
    marks[7::11] = False
    positions = torch.nonzero(marks.reshape(-1)).squeeze(-1)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e38, 1e-40, -0.0, 70000.0, -3.5])
    values = special.repeat(positions.numel() // special.numel() + 1)[: positions.numel()].to(torch.bfloat16)
    return SalientWeights(positions, values)


@pytest.mark.parametrize("scheme", SALIENT_SCHEMES, ids=QuantScheme.describe)
def test_salient_weights_are_written_by_the_kernel_row_by_row(
    scheme: QuantScheme, kernel_writes: list[tuple[int, int]]
) -> None:
    rows, cols = 3 * 70, 256
    dense = scheme.quantize(weights(12, (3, 70, cols)))
    q = QuantizedTensor(scheme, dense.shape, dense.packed, dense.scales, dense.zeros, edge_salient(rows, cols))
    for dtype in DTYPES:
        assert_same(q.dequantize(dtype), q._dequantize_reference(dtype))
    assert len(kernel_writes) == len(DTYPES) and all(written == count for written, count in kernel_writes)


@pytest.mark.parametrize(
    "positions",
    [
        pytest.param([40, 3, 700, 12], id="unsorted"),
        pytest.param([3, 12, 12, 700], id="repeated"),
        pytest.param([3, 12, 700, -1], id="negative"),
        pytest.param([3, 700, 701, 699], id="unsorted-in-a-row"),
    ],
)
def test_salient_positions_the_kernel_does_not_trust_are_written_by_torch(
    positions: list[int], kernel_writes: list[tuple[int, int]]
) -> None:
    """Positions out of order, repeated or negative (``index_put_`` counts from the end) are left to torch, so
    the result is still the reference's."""
    scheme = QuantScheme("binary", group_size=64)
    dense = scheme.quantize(weights(13, (2, 8, 128)))
    values = torch.tensor([1.5, -2.0, 3.0, 7.0], dtype=torch.bfloat16)
    salient = SalientWeights(torch.tensor(positions), values)
    q = QuantizedTensor(scheme, dense.shape, dense.packed, dense.scales, None, salient)
    for dtype in (torch.bfloat16, torch.float32):
        assert_same(q.dequantize(dtype), q._dequantize_reference(dtype))
    assert kernel_writes and all(written < count for written, count in kernel_writes)


def test_salient_positions_int32_or_out_of_range_behave_as_the_reference() -> None:
    scheme = QuantScheme("int4", group_size=32)
    dense = scheme.quantize(weights(14, (4, 64)))
    values = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    narrow = QuantizedTensor(
        scheme,
        dense.shape,
        dense.packed,
        dense.scales,
        None,
        SalientWeights(torch.tensor([5, 200], dtype=torch.int32), values),
    )
    assert_same(narrow.dequantize(torch.bfloat16), narrow._dequantize_reference(torch.bfloat16))
    beyond = QuantizedTensor(
        scheme, dense.shape, dense.packed, dense.scales, None, SalientWeights(torch.tensor([5, 256]), values)
    )
    for dequantize in (beyond.dequantize, beyond._dequantize_reference):
        with pytest.raises(IndexError):
            dequantize(torch.bfloat16)


WORD_PERMUTE = [False, True] if dequant._PERMUTES_WORDS else [False]


@pytest.mark.parametrize("permute", WORD_PERMUTE, ids=lambda on: "vpermw" if on else "table")
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_every_scale_bit_pattern_and_zero_point_matches_the_reference(
    permute: bool, symmetric: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All 65,536 bf16 scales with random codes and zero points: 16-bit outputs permute the group's 16 table
    entries by the codes where the CPU has ``vpermw``, and look each weight up otherwise."""
    monkeypatch.setattr(dequant, "_PERMUTES_WORDS", permute)
    scheme = QuantScheme("int4", group_size=32, symmetric=symmetric)
    generator = torch.Generator().manual_seed(15)
    scales = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(2048, 32)
    packed = torch.randint(0, 256, (2048, 512), generator=generator, dtype=torch.int32).to(torch.uint8)
    zeros = None if symmetric else torch.randint(0, 16, (2048, 32), generator=generator).to(torch.uint8)
    q = QuantizedTensor(scheme, (2048, 1024), packed, scales, zeros)
    for dtype in DTYPES:
        assert q._dequantize_fast(dtype) is not None
        assert_same(q.dequantize(dtype), q._dequantize_reference(dtype))


@pytest.mark.parametrize("permute", WORD_PERMUTE, ids=lambda on: "vpermw" if on else "table")
def test_mxfp4_every_scale_and_code_matches_the_reference(permute: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every E8M0 scale with every code in both nibbles of a byte: each row holds the 256 bytes, its 16 groups 16
    different scales, the rows together every scale 16 times."""
    monkeypatch.setattr(dequant, "_PERMUTES_WORDS", permute)
    scheme = QuantScheme("mxfp4")
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1)
    scales = ((torch.arange(256)[:, None] + torch.arange(16) * 16) % 256).to(torch.uint8)
    q = QuantizedTensor(scheme, (256, 512), packed, scales)
    for dtype in DTYPES:
        assert q._dequantize_fast(dtype) is not None
        assert_same(q.dequantize(dtype), q._dequantize_reference(dtype))


def test_int4_group_sizes_off_the_permute_width_take_the_table() -> None:
    q = QuantScheme("int4", group_size=32).quantize(weights(16, (4, 64)))
    scales = q.scales.repeat_interleave(4, -1)
    dense = dequant.integer(q.packed, scales, None, 4, 8, q.shape, torch.bfloat16)
    want = QuantizedTensor(QuantScheme("int4", group_size=32), q.shape, q.packed, q.scales)
    assert_same(dense, want._dequantize_reference(torch.bfloat16))
