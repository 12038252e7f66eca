"""Number formats: MXFP4 against transformers' own gpt-oss dequantisation and a brute-force reading of the OCP
spec; integer grids; bit packing; W4A8 activations."""

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecompress.kernels import intq, mxfp4, w4a8
from moecompress.kernels.packing import pack_codes, unpack_codes
from moecompress.quantization.scheme import QuantScheme

MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _awkward_weights(seed: int = 0) -> torch.Tensor:
    """Random weights plus blocks that hit the edge cases: all zero, exact ties, saturation, tiny and huge."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 8, 128, generator=g) * torch.logspace(-3, 1, 8).reshape(1, 8, 1)
    w[0, 0, :32] = 0
    w[0, 1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0] * 4) * 2.0
    w[0, 1, 0] = 8.0  # amax 8 -> floor exponent 1: the ties above become 0.25 .. 5 after scaling
    w[0, 2, :32] = torch.linspace(-7, 7, 32)
    w[1, 0, :32] = 1e-30
    w[1, 1, :32] = 3e30
    for row, k in enumerate((-3, 0, 2, 3, 5, 9)):  # amax just below a power of two: log2 would round up
        w[2, row, :32] = torch.linspace(-1, 1, 32) * 2.0**k * (1 - 2.0**-24)
    w[1, 3, :32] = 6.0 * 2.0**3 * (1 + 2.0**-23)  # amax/6 just above a power of two: ceil must round up
    w[1, 4, :32] = 6.0 * 2.0**3
    return w


def _spec_codes(values: list[float], rule: str) -> tuple[list[int], int]:
    """OCP MX v1.0 read literally, in float64 Python: one block → (codes, biased exponent)."""
    amax = max(abs(v) for v in values)
    if amax == 0:
        exponent = -127
    elif rule == "floor":
        exponent = math.frexp(amax)[1] - 1 - 2
    else:
        ratio = float(torch.tensor(amax, dtype=torch.float32) / 6.0)  # gpt-oss divides in float32
        mantissa, exponent = math.frexp(ratio)
        exponent = exponent - 1 if mantissa == 0.5 else exponent
    exponent = max(-127, min(127, exponent))
    codes = []
    for v in values:
        scaled = abs(v) / 2.0**exponent
        distances = [abs(scaled - m) for m in MAGNITUDES]
        best = min(distances)
        candidates = [i for i, d in enumerate(distances) if d == best]
        code = next((i for i in candidates if i % 2 == 0), candidates[0])
        if scaled > 6.0:
            code = 7
        codes.append(code | (8 if v < 0 and code else 0))
    return codes, exponent + 127


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_mxfp4_matches_a_literal_reading_of_the_spec(rule):
    w = _awkward_weights()
    packed, scales = mxfp4.quantize_mxfp4(w, rule)
    codes = unpack_codes(packed, 4).reshape(-1, 32)
    for block, (values, got_codes, got_scale) in enumerate(
        zip(w.reshape(-1, 32), codes, scales.reshape(-1), strict=True)
    ):
        want_codes, want_scale = _spec_codes(values.double().tolist(), rule)
        assert got_codes.tolist() == want_codes, block
        assert int(got_scale) == want_scale, block


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_mxfp4_dequantises_identically_with_transformers_gpt_oss_code(rule):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = _awkward_weights(1)
    packed, scales = mxfp4.quantize_mxfp4(w, rule)
    ours = mxfp4.dequantize_mxfp4(packed, scales)
    blocks = packed.reshape(*packed.shape[:-1], -1, 16)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows]
    assert torch.equal(theirs.transpose(1, 2), ours)


def test_mxfp4_ceil_rule_never_saturates_and_floor_can():
    w = torch.full((1, 32), 7.0)
    floor_values = mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(w, "floor"))
    ceil_values = mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(w, "ceil"))
    assert torch.all(floor_values == 6.0)  # 7 / 2**0 saturates at 6
    assert torch.all(ceil_values == 8.0)  # scale 2 -> 3.5 -> ties to 4 (even) -> 8


@settings(max_examples=50, deadline=None)
@given(bits=st.sampled_from([1, 2, 4, 8]), rows=st.integers(1, 4), groups=st.integers(1, 6), seed=st.integers(0, 99))
def test_pack_unpack_round_trip(bits, rows, groups, seed):
    per_byte = 8 // bits
    codes = torch.randint(0, 2**bits, (rows, groups * per_byte), generator=torch.Generator().manual_seed(seed))
    packed = pack_codes(codes, bits)
    assert packed.shape == (rows, groups)
    assert torch.equal(unpack_codes(packed, bits), codes.to(torch.uint8))


def test_four_bit_packing_puts_the_even_element_in_the_low_nibble():
    assert pack_codes(torch.tensor([[0x3, 0xA]]), 4).tolist() == [[0xA3]]


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (2, True), (2, False)])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_integer_grid_error_is_at_most_half_a_step_and_stored_grid_reproduces_codes(bits, symmetric, group):
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(bits + group))
    packed, scales, zeros = intq.quantize_int(w, bits, group, symmetric)
    assert (zeros is None) == symmetric
    values = intq.dequantize_int(packed, scales, zeros, bits, group)
    step = scales.float().repeat_interleave(group, dim=-1)
    low = -(2 ** (bits - 1)) * step if symmetric else None
    inside = (w >= low) & (w <= (2 ** (bits - 1) - 1) * step) if symmetric else torch.ones_like(w, dtype=torch.bool)
    bf16_half_ulp = values.abs() * 2.0**-8
    assert torch.all((values - w).abs()[inside] <= (step / 2 + bf16_half_ulp + 1e-6)[inside])
    scheme = QuantScheme(f"int{bits}", group, symmetric)
    q = scheme.quantize(w)
    assert torch.equal(q.dequantize(), values)
    assert torch.equal(scheme.codes(scheme.grouped(values), q.grid()).reshape(w.shape), q.codes())


def test_asymmetric_grid_keeps_zero_exact():
    w = torch.rand(4, 64) + 0.5
    w[:, 3] = 0.0
    values = intq.dequantize_int(*intq.quantize_int(w, 2, 32, False), 2, 32)
    assert torch.all(values[:, 3] == 0)


def test_scheme_quantize_round_trip_and_sizes():
    w = torch.randn(2, 64, 128)
    for scheme, bits_per_weight in [
        (QuantScheme("mxfp4"), 4.25),
        (QuantScheme("int4", 32), 4.5),
        (QuantScheme("int4", 128), 4.125),
        (QuantScheme("int2", 32, symmetric=False), 2.75),
    ]:
        q = scheme.quantize(w)
        assert q.nbytes * 8 / q.numel == bits_per_weight
        assert q.dequantize().shape == w.shape
        assert torch.equal(q.take_rows(torch.arange(64)).packed, q.packed)


def test_w4a8_activation_codes_are_int8_per_token():
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 10.0, 0.0, 3.0]).unsqueeze(1)
    codes, scale = w4a8.quantize_activations(x)
    assert codes.dtype == torch.int8 and scale.shape == (5, 1)
    assert torch.all(codes.abs().amax(dim=1)[[0, 1, 2, 4]] == 127)
    fake = w4a8.fake_quantize_activations(x)
    assert torch.all((fake - x).abs() <= scale / 2 + 1e-7)
    assert torch.all(fake[3] == 0)


@pytest.mark.parametrize("rule", ["floor", "ceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mxfp4_kernel_is_bit_identical_to_the_reference(rule, dtype):
    from moecompress.kernels import mxfp4_fused

    if not mxfp4_fused.available():
        pytest.skip("numba not installed")
    for w in (_awkward_weights(3), torch.randn(4, 96, 256, generator=torch.Generator().manual_seed(4)) * 0.02):
        w = w.to(dtype)
        reference = mxfp4.quantize_mxfp4(w, rule)
        fused = mxfp4_fused.quantize_mxfp4(w, rule)
        assert torch.equal(fused[0], reference[0]) and torch.equal(fused[1], reference[1])


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_fused_mxfp4_kernel_on_every_finite_bf16_value(rule):
    """The bf16 kernel widens by table lookup and finds a block's largest magnitude on the bits: every finite
    bf16 value, in blocks of mixed magnitudes (shuffled) and of neighbouring ones (sorted), as the reference."""
    from moecompress.kernels import mxfp4_fused

    if not mxfp4_fused.available():
        pytest.skip("numba not installed")
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[torch.isfinite(values)]
    values = values[: values.numel() // 256 * 256]
    shuffled = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(0))]
    for w in (shuffled.reshape(-1, 256), values.reshape(-1, 256)):
        reference = mxfp4.quantize_mxfp4(w, rule)
        fused = mxfp4_fused.quantize_mxfp4(w, rule)
        assert torch.equal(fused[0], reference[0]) and torch.equal(fused[1], reference[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_the_finite_check_finds_every_nan_and_inf(dtype):
    from moecompress.kernels.finite import all_finite

    values = torch.randn(3 * 2**16 + 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    values[11] = torch.finfo(dtype).max
    values[12] = -torch.finfo(dtype).max
    values[13] = torch.finfo(dtype).tiny / 4
    assert all_finite(values)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for position in (0, 2**16 + 3, values.numel() - 1):
            broken = values.clone()
            broken[position] = bad
            assert not all_finite(broken), (bad, position)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to tell one thread from all of them")
def test_the_numba_kernels_leave_torch_on_its_thread_count():
    """Numba's OpenMP pool shares libgomp with torch; its launch must not move torch off OMP_NUM_THREADS=1
    (that changed the float rounding of later reductions between a fresh and a resumed run)."""
    script = (
        "import torch\n"
        "from moecompress.kernels.finite import all_finite\n"
        "from moecompress.kernels.mxfp4_fused import quantize_mxfp4\n"
        "all_finite(torch.zeros(1 << 20))\n"
        "quantize_mxfp4(torch.randn(64, 64))\n"
        "print(torch.get_num_threads())\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["1"]
