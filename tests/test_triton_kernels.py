"""Every Triton kernel against its torch reference: compiled on a GPU when one is present, otherwise on CPU
under the Triton interpreter.

``TRITON_INTERPRET=1`` only works if it is set before triton is first imported, and the suite's conftest
imports transformers, which imports triton. Without a GPU, this file therefore reruns itself in a fresh pytest
process with the variable set from the start (one test here, the cases there).
"""

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from moecompress.kernels import binary, golomb_rice
from moecompress.kernels.intq import quantize_int
from moecompress.kernels.moe_routing import group_pairs
from moecompress.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from moecompress.kernels.packing import pack_codes
from moecompress.kernels.w4a8 import quantize_activations, w4a8_linear

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def _interpreter_active() -> bool:
    import triton.language.standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.standard.zeros, InterpretedFunction)


RERUN = not GPU and not _interpreter_active()

if RERUN:

    def test_kernels_under_the_interpreter():
        env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        command = [sys.executable, "-m", "pytest", __file__, "-q", "-o", "addopts=", "-p", "no:cacheprovider"]
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
        summary = result.stdout.strip().splitlines()[-1]
        assert " passed" in summary and "skipped" not in summary, summary


@pytest.fixture(scope="module")
def k():
    """The kernel modules (compiled on a GPU, interpreted on CPU); skipped where the rerun covers them."""
    if RERUN:
        pytest.skip("run under the interpreter by test_kernels_under_the_interpreter")
    from moecompress.kernels import triton_binary, triton_golomb_rice, triton_moe, triton_mxfp4, triton_w4a8

    assert GPU or _interpreter_active()
    return SimpleNamespace(
        mxfp4=triton_mxfp4, moe=triton_moe, w4a8=triton_w4a8, binary=triton_binary, golomb_rice=triton_golomb_rice
    )


def dtypes():
    """Activation dtypes to test: fp32 (tight) and bf16 under the interpreter; bf16 only on a GPU."""
    return [torch.bfloat16] if GPU else [torch.float32, torch.bfloat16]


def assert_matches(actual, expected):
    """fp32: summation order only; bf16: one rounding of the output either way (plus order effects)."""
    actual, expected = actual.float().cpu(), expected.float().cpu()
    scale = expected.abs().max().item() + 1e-12
    if expected.dtype == torch.float32 and actual.dtype == torch.float32 and not GPU:
        tolerance = 2e-6 * scale + 2e-6 * expected.abs()
    else:
        tolerance = 2e-3 * scale + 2**-7 * expected.abs()
    excess = (actual - expected).abs() - tolerance
    assert excess.max().item() <= 0, f"max excess {excess.max().item():.3g} over tolerance (scale {scale:.3g})"


def on(*tensors):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tensors]


# ---- MXFP4 ------------------------------------------------------------------------------------------------------
def test_mxfp4_tile_decodes_every_code_and_scale_exactly(k):
    """With the identity as activations the kernel returns the dequantised weight itself: every E2M1 code at
    every E8M0 scale from 0 (subnormal) to 252 (above it ±6 overflows fp32, and the dot's 0 · inf is NaN)."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(253 * 2)  # 16 codes × 2 = one 32-block per scale
    packed = pack_codes(codes, 4).reshape(253, 16)
    scales = torch.arange(253, dtype=torch.uint8).reshape(253, 1)
    expected = dequantize_mxfp4(packed, scales)
    eye = torch.eye(32)
    if GPU:  # bf16 on a GPU: the identity and the (bf16-exact) weights multiply exactly
        eye = eye.bfloat16()
        expected = expected.bfloat16().float()
    out = k.mxfp4.mxfp4_linear(*on(eye, packed, scales)).float().cpu()
    assert torch.equal(out.T, expected)


@pytest.mark.parametrize("rows", [1, 5, 19])
@pytest.mark.parametrize("dtype", dtypes())
def test_mxfp4_linear_matches_reference(k, rows, dtype):
    torch.manual_seed(rows)
    weight = torch.randn(80, 96) * 0.1
    weight[0, :32] = 0.0
    weight[3, 32:64] *= 1e3
    packed, scales = quantize_mxfp4(weight)
    x = torch.randn(rows, 96).to(dtype)
    bias = torch.randn(80).to(dtype)
    x, packed, scales, bias = on(x, packed, scales, bias)
    for b in (None, bias):
        expected = k.mxfp4.mxfp4_linear_reference(x, packed, scales, b)
        assert_matches(k.mxfp4.mxfp4_linear(x, packed, scales, b), expected)
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
    assert_matches(
        k.mxfp4.mxfp4_linear(x, packed, scales, config=config), k.mxfp4.mxfp4_linear_reference(x, packed, scales)
    )


# ---- fused MoE --------------------------------------------------------------------------------------------------
def test_group_pairs_puts_every_routed_pair_once_in_a_block_of_its_expert():
    ids = torch.tensor([[0, 2], [2, -1], [2, 0], [5, 2], [0, 2]])
    blocks = group_pairs(ids, num_experts=4, block=2)
    flat = ids.reshape(-1)
    pairs = blocks.pairs.reshape(-1, 2)
    seen = []
    for block, expert in enumerate(blocks.experts.tolist()):
        members = [p for p in pairs[block].tolist() if p < blocks.num_pairs]
        if expert < 0:
            assert not members
            continue
        assert members and all(flat[p] == expert for p in members)
        seen += members
    valid = [p for p in range(flat.numel()) if 0 <= flat[p] < 4]
    assert sorted(seen) == valid
    assert blocks.experts.numel() == -(-flat.numel() // 2) + 4
    assert (blocks.experts[blocks.experts >= 0].diff() >= 0).all()


def _moe(k, experts, hidden, inter, *, bias, adapters, seed=0):
    torch.manual_seed(seed)
    gate_up = quantize_mxfp4(torch.randn(experts, 2 * inter, hidden) * 0.1)
    down = quantize_mxfp4(torch.randn(experts, hidden, inter) * 0.1)
    moe = k.moe
    extra = {}
    if bias:
        extra["gate_up_bias"] = torch.randn(experts, 2 * inter) * 0.1
        extra["down_bias"] = torch.randn(experts, hidden) * 0.1
    if adapters:

        def factors(rows, cols):
            return {e: (torch.randn(rows, 2 + 3 * e) * 0.1, torch.randn(2 + 3 * e, cols) * 0.1) for e in (0, 2)}

        rank = moe.padded_rank([2 + 3 * e for e in (0, 2)])
        extra["gate"] = moe.pad_adapters(factors(inter, hidden), experts, inter, hidden, rank)
        extra["up"] = moe.pad_adapters(factors(inter, hidden), experts, inter, hidden, rank)
        extra["down_adapter"] = moe.pad_adapters(factors(hidden, inter), experts, hidden, inter, rank)
    moved = {}
    for name, value in extra.items():
        if isinstance(value, moe.Adapters):
            moved[name] = moe.Adapters(value.left.to(DEVICE), value.right.to(DEVICE))
        else:
            moved[name] = value.to(DEVICE)
    return moe.MXFP4Experts(*on(*gate_up, *down), **moved)


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("dtype", dtypes())
def test_fused_moe_matches_reference(k, tokens, dtype):
    """Odd token counts, an expert that receives no token (3), an id routed nowhere (-1), biases, adapters of
    different ranks (expert 1 has none), both activations."""
    experts = _moe(k, 4, 64, 32, bias=True, adapters=True)
    torch.manual_seed(tokens)
    ids = torch.randint(0, 3, (tokens, 2))
    ids[0, 1] = -1
    weights = torch.rand(tokens, 2)
    hidden = torch.randn(tokens, 64).to(dtype)
    hidden, ids, weights = on(hidden, ids, weights)
    for activation in (k.moe.Activation("silu"), k.moe.Activation("swigluoai", alpha=1.702, limit=0.5)):
        expected = k.moe.fused_moe_reference(hidden, ids, weights, experts, activation)
        assert_matches(k.moe.fused_moe_mxfp4(hidden, ids, weights, experts, activation), expected)


@pytest.mark.parametrize("dtype", dtypes())
def test_fused_moe_several_blocks_per_expert_without_extras(k, dtype):
    experts = _moe(k, 2, 64, 96, bias=False, adapters=False, seed=3)
    ids = torch.tensor([[0, 1]] * 11 + [[1, 0]] * 6)
    weights = torch.rand(17, 2)
    hidden = torch.randn(17, 64).to(dtype)
    hidden, ids, weights = on(hidden, ids, weights)
    config = k.moe.MoEConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
    expected = k.moe.fused_moe_reference(hidden, ids, weights, experts, k.moe.Activation())
    assert_matches(k.moe.fused_moe_mxfp4(hidden, ids, weights, experts, k.moe.Activation(), config), expected)


# ---- W4A8 -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("symmetric", "group_size", "rows"), [(True, 32, 1), (False, 128, 5), (False, 32, 3)])
def test_w4a8_integer_product_is_exact(k, symmetric, group_size, rows):
    torch.manual_seed(group_size + rows)
    weight = torch.randn(70, 256) * 0.1
    packed, scales, zeros = quantize_int(weight, 4, group_size, symmetric)
    codes_x, scale_x = quantize_activations(torch.randn(rows, 256) * 3)
    bias = torch.randn(70)
    args = on(codes_x, scale_x, packed, scales, zeros)
    for b in (None, bias.to(DEVICE)):
        out = k.w4a8.w4a8_matmul(*args, group_size, b).cpu()
        expected = k.w4a8.w4a8_integer_reference(
            *[a.cpu() if a is not None else None for a in args], group_size, None if b is None else b.cpu()
        )
        if GPU:  # fused multiply-adds may move the last bit of the fp32 combination
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(out, expected)


def test_w4a8_integer_reference_agrees_with_the_dequantising_reference(k):
    torch.manual_seed(0)
    weight = torch.randn(48, 128) * 0.1
    packed, scales, zeros = quantize_int(weight, 4, 32, False)
    x = torch.randn(4, 128)
    from moecompress.kernels.intq import dequantize_int

    dense = w4a8_linear(x, dequantize_int(packed, scales, zeros, 4, 32))
    exact = k.w4a8.w4a8_linear_integer_reference(x, packed, scales, zeros, 32)
    torch.testing.assert_close(exact, dense, rtol=2e-2, atol=2e-2 * dense.abs().max().item())
    assert_matches(
        k.w4a8.w4a8_linear_triton(*on(x.to(dtypes()[-1]), packed, scales, zeros), 32),
        k.w4a8.w4a8_linear_integer_reference(x.to(dtypes()[-1]), packed, scales, zeros, 32),
    )


# ---- binary -----------------------------------------------------------------------------------------------------
def _binary(rows, cols, group_size, salient, seed):
    torch.manual_seed(seed)
    weight = torch.randn(rows, cols)
    grouped = weight.reshape(rows, cols // group_size, group_size)
    scales = binary.group_scales(grouped).squeeze(-1).to(binary.SCALE_DTYPE)
    packed = pack_codes(binary.sign_codes(weight), 1)
    positions = torch.sort(torch.randperm(rows * cols)[:salient]).values
    positions[0] = 0  # the first row and the last position are salient too
    positions = torch.unique(torch.cat([positions, torch.tensor([rows * cols - 1])]))
    values = (torch.randn(positions.numel()) * 3).to(torch.bfloat16)
    return packed, scales, positions, values


@pytest.mark.parametrize(("rows", "group_size", "salient"), [(1, 64, 200), (5, 256, 0), (18, 32, 700)])
@pytest.mark.parametrize("dtype", dtypes())
def test_binary_linear_with_salient_correction_matches_reference(k, rows, group_size, salient, dtype):
    packed, scales, positions, values = _binary(70, 256, group_size, max(salient, 1), rows)
    x = torch.randn(rows, 256).to(dtype)
    bias = torch.randn(70).to(dtype)
    x, packed, scales, positions, values, bias = on(x, packed, scales, positions, values, bias)
    base = k.binary.binary_dequantize(packed, scales, group_size)
    kept = (positions, values) if salient else None
    correction = k.binary.salient_correction(positions, values, base, (70, 256)) if salient else None
    expected = k.binary.binary_linear_reference(x, packed, scales, group_size, kept, bias)
    assert_matches(k.binary.binary_linear(x, packed, scales, group_size, correction, bias), expected)
    if salient:  # the correction is not a no-op: without it the answer is wrong
        plain = k.binary.binary_linear(x, packed, scales, group_size, None, bias)
        assert (plain.float() - expected.float()).abs().max() > 0.1


# ---- Golomb-Rice ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "density", "length", "chunk_symbols", "parameter"),
    [
        ("rice", 0.05, 5000, 64, None),
        ("golomb", 0.03, 7001, 50, None),
        ("golomb", 0.2, 3000, 33, 5),
        ("rice", 0.002, 30000, 5, 0),  # unary runs far longer than a window
        ("golomb", 0.002, 30000, 7, 3),
        ("rice", 0.6, 2000, 100, None),
        ("golomb", 1.0, 300, 16, 1),
    ],
)
def test_golomb_rice_decode_matches_reference(k, code, density, length, chunk_symbols, parameter):
    bits = np.random.default_rng(length).random(length) < density
    data = golomb_rice.encode(bits, code=code, chunk_symbols=chunk_symbols, parameter=parameter)
    container = k.golomb_rice.GPUContainer(data, DEVICE)
    assert container.chunks > 1
    positions = k.golomb_rice.decode_positions(container, block=64).cpu().numpy()
    np.testing.assert_array_equal(positions, golomb_rice.decode_indices(data))


def test_golomb_rice_decode_of_an_empty_bitmap_and_a_corrupt_payload(k):
    empty = golomb_rice.encode(np.zeros(100, dtype=bool))
    assert k.golomb_rice.decode_positions(k.golomb_rice.GPUContainer(empty, DEVICE)).numel() == 0
    bits = np.random.default_rng(0).random(4000) < 0.05
    data = bytearray(golomb_rice.encode(bits, code="rice", chunk_symbols=32))
    data[-5:] = b"\x00" * 5  # the last quotients' terminators are gone
    with pytest.raises(ValueError, match="corrupt"):
        k.golomb_rice.decode_positions(k.golomb_rice.GPUContainer(bytes(data), DEVICE), block=64)
