"""Load-aware low-rank compensation: the greedy allocation is optimal, the weighted error falls strictly with the
budget (predicted and measured), and the written adapters load and reproduce the reported perplexity."""

import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecompress.checkpoint import CheckpointReader
from moecompress.checkpoint.stream import group_keys_by_layer
from moecompress.evals.perplexity import evaluate
from moecompress.families import adapter_for
from moecompress.loading import load_model
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint
from moecompress.quantization import sensitivity
from moecompress.quantization.compensation import layer_errors, measured_error
from moecompress.quantization.experts import quantize_experts_rtn
from moecompress.quantization.lowrank import (
    allocate,
    error_spectrum,
    squared_singular_values,
    truncated_svd,
)
from moecompress.quantization.scheme import QuantScheme
from moecompress.quantization.sensitivity import block_output_fisher, layer_sensitivity, stored_layer_sensitivity
from moecompress.sweep.engine import CalibrationSweep


def _value(gains, loads, ranks):
    return sum(loads[k] * sum(gains[k][: ranks[k]]) for k in gains)


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.lists(st.integers(0, 6), min_size=1, max_size=4),
            st.integers(1, 4),
        ),
        min_size=1,
        max_size=4,
    ),
    budget=st.integers(0, 10),
)
def test_greedy_allocation_is_optimal_against_brute_force(data, budget):
    gains = {i: torch.tensor(sorted(g, reverse=True), dtype=torch.float64) for i, (g, _) in enumerate(data)}
    loads = {i: float(load) for i, (_, load) in enumerate(data)}
    greedy = allocate(gains, loads, budget, "load")
    assert sum(greedy.values()) <= budget
    best = max(
        _value(gains, loads, dict(zip(gains, ranks, strict=True)))
        for ranks in itertools.product(*(range(len(g) + 1) for g in gains.values()))
        if sum(ranks) <= budget
    )
    assert _value(gains, loads, greedy) == pytest.approx(best)


def test_uniform_allocation_gives_every_matrix_the_same_rank():
    gains = {k: torch.tensor([5.0, 3.0, 1.0]) for k in range(4)}
    assert set(allocate(gains, dict.fromkeys(range(4), 1.0), 9, "uniform").values()) == {2}


@pytest.fixture(scope="module")
def layer(tiny_checkpoints):
    source = tiny_checkpoints["qwen3_moe"]
    with CheckpointReader(source) as reader:
        adapter = adapter_for(reader.config)
        keys, _ = group_keys_by_layer(reader, adapter)
        moe, _, _ = adapter.split_layer(0, reader.read(keys[0]))
    hidden = torch.randn(800, moe.gate_up.shape[-1], generator=torch.Generator().manual_seed(0))
    hidden = hidden @ torch.randn(hidden.shape[1], hidden.shape[1], generator=torch.Generator().manual_seed(1)) * 0.3
    quantized = quantize_experts_rtn(moe, QuantScheme("int2", 32, symmetric=False))
    return adapter, moe, quantized, hidden


@pytest.mark.parametrize("sensitive", [False, True])
def test_weighted_error_falls_strictly_with_the_budget_predicted_and_measured(layer, sensitive):
    adapter, moe, quantized, hidden = layer
    weights = torch.rand(hidden.shape[0], generator=torch.Generator().manual_seed(3)) * 4 if sensitive else None
    errors = layer_errors(
        adapter, moe, quantized, hidden, keep=32, min_tokens=16, keep_inputs=True, token_weights=weights
    )
    gains = {k: s.sigma2 for k, s in errors.spectra.items()}
    predicted, measured = [], []
    for budget in range(0, 40, 4):
        ranks = allocate(gains, errors.loads, budget, "load", max_rank=32)
        predicted.append(sum(errors.loads[k] * s.residual(ranks[k]) for k, s in errors.spectra.items()))
        measured.append(measured_error(errors, ranks))
    assert all(b < a for a, b in itertools.pairwise(predicted))
    assert all(b < a for a, b in itertools.pairwise(measured))
    torch.testing.assert_close(torch.tensor(measured), torch.tensor(predicted), rtol=1e-3, atol=0)


def test_measuring_as_it_goes_equals_measuring_from_the_kept_inputs(layer):
    adapter, moe, quantized, hidden = layer
    weights = torch.rand(hidden.shape[0], generator=torch.Generator().manual_seed(4)) + 0.5
    kept = layer_errors(adapter, moe, quantized, hidden, keep=8, min_tokens=16, keep_inputs=True, token_weights=weights)
    ranks = allocate({k: s.sigma2 for k, s in kept.spectra.items()}, kept.loads, 40, "load", max_rank=8)
    streamed = layer_errors(
        adapter, moe, quantized, hidden, keep=ranks, min_tokens=16, measure=True, token_weights=weights
    )
    assert not streamed.errors and not streamed.inputs
    assert streamed.measured == pytest.approx((measured_error(kept, {}), measured_error(kept, ranks)), rel=1e-6)
    assert streamed.measured[1] < streamed.measured[0]
    rewriting = layer_errors(
        adapter, moe, quantized, hidden, keep=ranks, min_tokens=16, measure=True, token_weights=weights, only_kept=True
    )
    assert set(rewriting.spectra) == {key for key, rank in ranks.items() if rank} != set(ranks)
    assert rewriting.measured == streamed.measured and rewriting.loads == streamed.loads


@pytest.mark.parametrize(
    "scheme", [QuantScheme("int2", 32, symmetric=False), QuantScheme("mxfp4"), QuantScheme("binary", 32)]
)
def test_one_expert_dequantises_to_its_slice_of_the_block(layer, scheme):
    _, moe, _, _ = layer
    quantized = quantize_experts_rtn(moe, scheme)
    for expert in (0, moe.num_experts - 1):
        gate_up, down = quantized.dequantized_expert(expert)
        block = quantized.dequantized()
        assert torch.equal(gate_up, block.gate_up[expert]) and torch.equal(down, block.down[expert])
        quantized._dequantized = None


def test_whitened_adapter_beats_plain_svd_on_the_routed_inputs():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(500, 64, generator=g) @ torch.diag(torch.logspace(0, -2, 64))
    error = torch.randn(48, 64, generator=g)

    def output_error(spectrum, rank):
        left, right = spectrum.adapter(rank)
        return float(((x @ (error - left @ right).T) ** 2).sum()) / x.shape[0]

    whitened = error_spectrum(error, x, keep=8, damp=1e-8)
    plain = error_spectrum(error, None, keep=8)
    for rank in (1, 4, 8):
        assert output_error(whitened, rank) == pytest.approx(whitened.residual(rank), rel=1e-4)
        assert output_error(whitened, rank) < output_error(plain, rank)


@pytest.mark.parametrize("shape", [(48, 64), (64, 48)])
@pytest.mark.parametrize("tokens", [20, 300])
def test_whitened_spectrum_is_the_svd_of_the_error_times_the_cholesky_factor(shape, tokens):
    """Both routes (the row Gram matrix without a factor for gate and up, the factor for down) against the
    definition in float64: the SVD of ``E·S``, ``S·Sᵀ`` the damped input covariance, and ``L·R = U_k Σ_k V_kᵀ S⁻¹``."""
    rows, cols = shape
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, cols, generator=g) @ torch.diag(torch.logspace(0, -2, cols))
    error = torch.randn(rows, cols, generator=g)
    covariance = x.double().T @ x.double() / tokens
    covariance += 1e-4 * covariance.diagonal().mean() * torch.eye(cols, dtype=torch.float64)
    factor = torch.linalg.cholesky(covariance)
    u, sigma, vh = torch.linalg.svd(error.double() @ factor, full_matrices=False)
    for keep in (0, 5):
        spectrum = error_spectrum(error, x, keep=keep)
        assert spectrum.whitened and spectrum.left.shape == (rows, keep) and spectrum.right.shape == (keep, cols)
        torch.testing.assert_close(spectrum.sigma2.double(), sigma**2, rtol=0, atol=1e-5 * float(sigma[0] ** 2))
    expected = (u[:, :5] * sigma[:5]) @ vh[:5] @ torch.linalg.inv(factor)
    left, right = spectrum.adapter(5)
    torch.testing.assert_close((left @ right).double(), expected, rtol=0, atol=1e-4 * float(expected.abs().max()))


@pytest.mark.parametrize("shape", [(48, 64), (64, 48), (1, 7)])
def test_spectra_and_factors_from_the_gram_matrix_match_the_svd(shape):
    g = torch.Generator().manual_seed(4)
    matrix = (torch.randn(*shape, generator=g) @ torch.diag(torch.logspace(0, -3, shape[1]))).double()
    expected = torch.linalg.svdvals(matrix) ** 2
    got = squared_singular_values(matrix)
    assert got.shape == expected.shape and bool((got[:-1] >= got[1:]).all()) and bool((got >= 0).all())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12 * float(expected[0]))
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    for keep in (1, 3):
        sigma2, left, right = truncated_svd(matrix, keep)
        k = min(keep, s.numel())
        assert left.shape == (shape[0], k) and right.shape == (k, shape[1])
        torch.testing.assert_close(sigma2, expected, rtol=0, atol=1e-12 * float(expected[0]))
        torch.testing.assert_close(left @ right, (u[:, :k] * s[:k]) @ vh[:k], rtol=0, atol=1e-10 * float(s[0]))
        torch.testing.assert_close(right @ right.T, torch.eye(k, dtype=torch.float64), rtol=0, atol=1e-9)


def test_spectra_without_factors_equal_the_svds_and_keep_is_per_matrix(layer):
    adapter, moe, quantized, hidden = layer
    full = layer_errors(adapter, moe, quantized, hidden, keep=4, min_tokens=16)
    ranks = {(0, "gate"): 3, (1, "down"): 1}
    partial = layer_errors(adapter, moe, quantized, hidden, keep=ranks, min_tokens=16)
    for key, spectrum in full.spectra.items():
        sigma2 = partial.spectra[key].sigma2
        torch.testing.assert_close(sigma2, spectrum.sigma2, rtol=0, atol=1e-6 * float(spectrum.sigma2[0]))
        kept = ranks.get(key, 0)
        assert partial.spectra[key].left.shape[1] == kept and partial.spectra[key].right.shape[0] == kept
        if kept:
            for ours, more in zip(partial.spectra[key].adapter(kept), spectrum.adapter(kept), strict=True):
                torch.testing.assert_close(ours, more, rtol=1e-5, atol=1e-6 * float(more.abs().max()))


def test_experts_with_too_few_tokens_fall_back_to_plain_svd(layer):
    adapter, moe, quantized, hidden = layer
    errors = layer_errors(adapter, moe, quantized, hidden, keep=2, min_tokens=10**6)
    assert errors.plain_svd == moe.expert_ids
    assert not any(s.whitened for s in errors.spectra.values())


def test_loads_are_routed_shares_and_gate_weighting_reweights_tokens(layer):
    adapter, moe, quantized, hidden = layer
    tokens = layer_errors(adapter, moe, quantized, hidden, keep=0, min_tokens=16, weighting="tokens")
    gate = layer_errors(adapter, moe, quantized, hidden, keep=0, min_tokens=16, weighting="gate")
    down_loads = [tokens.loads[(e, "down")] for e in range(moe.num_experts)]
    assert sum(down_loads) == pytest.approx(1.0)  # down's error is already in output units: load = routed share
    assert all(tokens.loads[(e, "gate")] > 0 for e in range(moe.num_experts))
    assert not torch.allclose(tokens.spectra[(0, "down")].sigma2, gate.spectra[(0, "down")].sigma2)


def test_constant_token_weights_scale_every_spectrum(layer):
    adapter, moe, quantized, hidden = layer
    plain = layer_errors(adapter, moe, quantized, hidden, keep=0, min_tokens=16)
    weighted = layer_errors(
        adapter, moe, quantized, hidden, keep=0, min_tokens=16, token_weights=torch.full((hidden.shape[0],), 3.0)
    )
    for key, spectrum in plain.spectra.items():
        torch.testing.assert_close(weighted.spectra[key].sigma2, 3 * spectrum.sigma2, rtol=1e-3, atol=1e-9)


def _calibration(source, sequences=3, length=16):
    ids = torch.randint(1, 200, (sequences, length), generator=torch.Generator().manual_seed(4))
    return [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}]


@pytest.mark.parametrize("head_windows", [None, 1])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_vl_moe"])
def test_streamed_block_output_fisher_is_the_whole_model_squared_loss_gradient(
    tiny_with_tokenizer, family, head_windows, tmp_path, monkeypatch
):
    """The layer-by-layer backward equals autograd through the whole model, in the sweep's token order; also with
    the head run one window at a time without the input embeddings (what a large vocabulary gets)."""
    source = tiny_with_tokenizer[family]
    adapter = adapter_for(json.loads((source / "config.json").read_text()))
    batches = _calibration(source)
    if head_windows is not None:
        calls = []
        monkeypatch.setattr(sensitivity, "windows_per_forward", lambda *args: calls.append(args) or head_windows)
    fisher = block_output_fisher(source, batches, spill_dir=tmp_path / "spill", progress=False)
    assert list((tmp_path / "spill").iterdir()) == []
    if head_windows is not None:
        assert calls, "the head was not split"
    model = load_model(source, adapter)
    model.requires_grad_(False)

    layers = adapter.moe_layers()
    seen, expected = {layer: [] for layer in layers}, {layer: [] for layer in layers}
    deltas: dict[int, torch.Tensor] = {}
    for batch in batches:

        def shift(layer):
            def hook(_module, args, output):
                seen[layer].append(args[0].detach().reshape(-1, args[0].shape[-1]))
                out = output[0] if isinstance(output, tuple) else output
                deltas[layer] = torch.zeros_like(out, requires_grad=True)
                return (out + deltas[layer], *output[1:]) if isinstance(output, tuple) else out + deltas[layer]

            return hook

        handles = [adapter.moe_block_of(model, layer).register_forward_hook(shift(layer)) for layer in layers]
        logits = model(**batch, use_cache=False).logits
        ids = batch["input_ids"]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        grads = torch.autograd.grad(loss, [deltas[layer] for layer in layers])
        for handle in handles:
            handle.remove()
        for layer, grad in zip(layers, grads, strict=True):
            expected[layer].append(grad.pow(2).mean(dim=-1).reshape(-1))
    for layer in layers:
        torch.testing.assert_close(fisher[layer], torch.cat(expected[layer]), rtol=1e-4, atol=1e-12)
    tags = torch.zeros(sum(b["input_ids"].numel() for b in batches), dtype=torch.long)
    for capture in CalibrationSweep(source, batches, tags, ["text"], progress=False).run():
        torch.testing.assert_close(capture.moe_input, torch.cat(seen[capture.layer]), rtol=1e-4, atol=1e-5)


def test_layer_sensitivity_is_normalised_and_fisher_is_the_per_token_mean(tiny_with_tokenizer):
    source = tiny_with_tokenizer["qwen3_moe"]
    batches = _calibration(source)
    tokens = layer_sensitivity(source, batches, "fisher-token")
    layers = layer_sensitivity(source, batches, "fisher")
    assert layer_sensitivity(source, batches, "none") == {}
    assert float(torch.cat(list(tokens.values())).mean()) == pytest.approx(1.0, rel=1e-5)
    for layer, values in tokens.items():
        assert values.numel() == 3 * 16
        assert float(layers[layer]) == pytest.approx(float(values.mean()), rel=1e-5)


def test_stored_sensitivity_is_reused_only_for_the_same_mode_and_tokens(tiny_with_tokenizer, tmp_path, monkeypatch):
    source = tiny_with_tokenizer["qwen3_moe"]
    batches = _calibration(source)
    stored = tmp_path / "state" / "sensitivity.safetensors"
    first = stored_layer_sensitivity(stored, source, batches, "fisher-token")
    assert stored.is_file()
    computed = []

    def count_computations(*args, **kwargs):
        computed.append(args[2])
        return layer_sensitivity(*args, **kwargs)

    monkeypatch.setattr(sensitivity, "layer_sensitivity", count_computations)
    again = stored_layer_sensitivity(stored, source, batches, "fisher-token")
    assert computed == [] and all(torch.equal(again[layer], first[layer]) for layer in first)
    stored_layer_sensitivity(stored, source, batches, "fisher")
    other_tokens = [{"input_ids": batch["input_ids"].flip(-1)} for batch in batches]
    stored_layer_sensitivity(stored, source, other_tokens, "fisher")
    assert computed == ["fisher", "fisher"]
    assert stored_layer_sensitivity(stored, source, batches, "none") == {}


@pytest.mark.parametrize("alloc", ["load", "uniform"])
def test_lowrank_checkpoint_reloads_to_the_reported_perplexity(tiny_with_tokenizer, tmp_path, alloc):
    source = tiny_with_tokenizer["qwen3_moe"]
    config = QuantizeConfig(scheme="int2", lowrank_budget=1.5, rank_alloc=alloc)
    out = tmp_path / "q"
    report = quantize_checkpoint(
        source, out, config, calib_tokens=2048, seq_len=64, eval_data="builtin:prose", eval_tokens=1024, progress=False
    )
    lowrank = report["lowrank"]
    assert 0 < lowrank["components_used"] <= lowrank["components"]
    assert lowrank["measured_weighted_error"]["with_adapters"] < lowrank["measured_weighted_error"]["without_adapters"]
    ranks = json.loads((out / "config.json").read_text())["quantization_config"]["lowrank"]
    used = sum(sum(r) for per_module in ranks.values() for r in per_module.values())
    assert used == lowrank["components_used"]
    hidden, inter = 64, 32
    assert report["footprint"]["classes"]["experts"]["adapter_bytes"] == used * (hidden + inter) * 2
    again = evaluate(out, "builtin:prose", seq_len=64, max_tokens=1024, progress=False)
    assert again.perplexity == pytest.approx(report["eval"]["perplexity"], rel=1e-9)
    plain = quantize_checkpoint(source, tmp_path / "plain", QuantizeConfig(scheme="int2"), progress=False)
    assert plain["footprint"]["classes"]["experts"]["adapter_bytes"] == 0
    kl = {
        name: evaluate(path, "builtin:prose", seq_len=64, max_tokens=1024, reference_dir=source, progress=False).kl
        for name, path in (("with", out), ("without", tmp_path / "plain"))
    }
    assert kl["with"] < kl["without"]


def test_lowrank_needs_the_native_format(tiny_checkpoints, tmp_path):
    from moecompress.errors import UserInputError

    with pytest.raises(UserInputError, match="native format"):
        quantize_checkpoint(
            tiny_checkpoints["gpt_oss"], tmp_path / "q", QuantizeConfig(format="gpt-oss", lowrank_budget=0.25)
        )
