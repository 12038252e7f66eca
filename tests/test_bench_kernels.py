"""``moecompress bench kernels``: the byte and FLOP accounting against hand-computed values, the bf16 MoE baseline
against a per-token loop, and the command's CPU run (no timed assertions)."""

import json

import pytest
import torch
from click.testing import CliRunner

from moecompress.errors import UserInputError
from moecompress.kernels import bench

QWEN3, MIXTRAL = bench.MODELS


def test_shapes_are_the_real_layers():
    assert (QWEN3.hidden, QWEN3.experts, QWEN3.intermediate, QWEN3.top_k) == (2048, 128, 768, 8)
    assert (MIXTRAL.hidden, MIXTRAL.experts, MIXTRAL.intermediate, MIXTRAL.top_k) == (4096, 8, 14336, 2)
    assert QWEN3.matrices() == [("gate_up", 1536, 2048), ("down", 2048, 768)]
    assert bench.token_counts(bench.SETTINGS["gpu"]) == (1, 4, 16, 2048)


def test_weight_bytes_by_hand():
    # Qwen3 gate_up: 1536 × 2048 = 3,145,728 weights; 4 bits → 1,572,864 B; one E8M0 byte per 32 → 98,304 B
    assert bench.mxfp4_bytes(1536, 2048) == 1_572_864 + 98_304
    assert bench.mxfp4_bytes(1536, 2048) * 8 / (1536 * 2048) == 4.25
    # down: 2048 × 768 = 1,572,864 weights → 786,432 + 49,152
    assert bench.mxfp4_bytes(2048, 768) == 835_584
    # INT4 group 32: codes 1,572,864 B + a bf16 scale per 32 weights (98,304 × 2 B), + a zero byte if asymmetric
    assert bench.int4_bytes(1536, 2048, 32) == 1_769_472
    assert bench.int4_bytes(1536, 2048, 32, symmetric=False) == 1_769_472 + 98_304
    # binary group 128: signs 393,216 B + 24,576 bf16 scales + 1537 int32 row starts + 100 × 12 B corrections
    assert bench.binary_bytes(1536, 2048, 128, 100) == 393_216 + 49_152 + 6_148 + 1_200
    assert bench.bf16_bytes(1536, 2048) == 6_291_456
    assert bench.positions_bytes(1_000) == 8_000


def test_moe_bytes_and_flops_by_hand():
    # a Qwen3 expert: 3 · 2048 · 768 = 4,718,592 weights; MXFP4: 1,671,168 + 835,584 = 2,506,752 B
    assert bench.expert_weights(QWEN3) == 4_718_592
    assert bench.moe_weight_bytes(QWEN3, 8) == 8 * 2_506_752
    # one token, top-8: 2 · 1 · 8 · 4,718,592
    assert bench.moe_flops(1, QWEN3) == 75_497_472
    # Mixtral: 3 · 4096 · 14336 = 176,160,768 weights an expert, 93,585,408 B in MXFP4
    assert bench.moe_weight_bytes(MIXTRAL, 2) == 2 * 93_585_408
    assert bench.moe_weight_bytes(MIXTRAL, 1, bench.bf16_bytes) == 2 * 176_160_768
    assert bench.moe_flops(16, MIXTRAL) == 2 * 16 * 2 * 176_160_768
    assert bench.linear_flops(16, 1536, 2048) == 100_663_296
    # ids outside [0, E) are routed nowhere and not counted
    assert bench.routed_experts(torch.tensor([[0, 2], [2, -1], [5, 1]]), 4) == 3


def test_rates_and_ratios():
    linear = bench.LinearFigure("mxfp4_linear", "m", "gate_up", 1, 1, 1, 2_000_000, 3_000_000_000, 0.5, 1.25)
    linear.finish(hbm_gbs=8000.0)
    assert linear.gbs == pytest.approx(4.0)  # 2e6 B / 5e-4 s = 4e9 B/s
    assert linear.tflops == pytest.approx(6.0)  # 3e9 FLOP / 5e-4 s = 6e12 FLOP/s
    assert linear.ratio == pytest.approx(2.5)
    assert linear.hbm_fraction == pytest.approx(0.0005)
    decoded = bench.DecodeFigure("rice", 0.01, 100_000_000, 1_000_000, 4096, 245, 1, 0.1, True)
    decoded.finish()
    assert decoded.output_gbs == pytest.approx(80.0)  # 8e6 B / 1e-4 s
    assert decoded.positions_per_s == pytest.approx(10.0)
    assert decoded.bitmap_positions_per_s == pytest.approx(1000.0)


def test_goals_are_checked_on_decode_cases_only():
    result = bench.BenchResult("gpu", True, "gpu", "", "", "torch._grouped_mm", 4800.0)
    for tokens, ms in ((1, 0.01), (2048, 1.0)):
        figure = bench.MoEFigure("m", 2048, 128, 768, 8, tokens, 8, 40_000_000, 1, ms, 0.02, 0.001, 0.008)
        figure.finish(4800.0)
        result.moe.append(figure)
    goals = bench.goal_checks(result)
    assert [g["case"] for g in goals] == ["m T=1"] * 3
    by_goal = {g["goal"].split(" ≥")[0]: g for g in goals}
    assert by_goal["fused MoE call"]["value"] == pytest.approx(4.0 / 4.8)  # 4000 GB/s of 4800
    assert by_goal["fused MoE call"]["met"]
    assert not by_goal["fused MoE"]["met"]  # 2× faster than bf16, not 2.5×
    assert bench.goal_checks(bench.BenchResult("cpu", False, "cpu", "", "", "", None)) == []


def test_reduced_shapes_fit_every_group_size():
    for setting in ("cpu", "quick"):
        for shape in bench.MODELS:
            small = bench.reduced(shape, bench.SETTINGS[setting].shrink)
            assert small.hidden % 128 == 0 and small.intermediate % 128 == 0
            assert 2 * small.top_k <= small.experts <= shape.experts and small.top_k == shape.top_k


def test_bf16_moe_baseline_matches_a_per_token_loop():
    torch.manual_seed(0)
    experts, hidden, inter, tokens, top_k = 4, 32, 16, 5, 2
    gate_up = torch.randn(experts, 2 * inter, hidden).bfloat16()
    down = torch.randn(experts, hidden, inter).bfloat16()
    ids = torch.tensor([[0, 2], [2, 3], [3, 0], [2, 0], [0, 3]])  # expert 1 gets nothing
    weights = torch.rand(tokens, top_k)
    x = torch.randn(tokens, hidden).bfloat16()
    out = bench.bf16_moe(x, ids, weights, gate_up.transpose(1, 2), down.transpose(1, 2))
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for slot in range(top_k):
            e = int(ids[t, slot])
            gu = x[t].float() @ gate_up[e].float().T
            h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            expected[t] += weights[t, slot] * (h @ down[e].float().T)
    torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2 * expected.abs().max().item())


def test_random_positions_are_a_bitmap_of_about_the_density():
    positions = bench.random_positions(1_000_000, 0.05)
    assert (positions[1:] > positions[:-1]).all() and positions[0] >= 0 and positions[-1] < 1_000_000
    assert abs(positions.size / 1_000_000 - 0.05) < 0.005


@pytest.fixture
def one_thread():
    """The CPU references at one thread: two threads on a shared two-core machine spend more time waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_command_on_cpu_says_no_gpu_and_writes_the_figures(tmp_path, one_thread):
    pytest.importorskip("triton")
    from moecompress.cli.main import app

    out = tmp_path / "kernels.json"
    result = CliRunner().invoke(app, ["bench", "kernels", "--quick", "--repeats", "1", "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    assert bench.CPU_NOTE in result.stdout
    assert "goals: not checked" in result.stdout and "total wall time" in result.stdout
    data = json.loads(out.read_text())
    assert data["gpu"] is False and data["setting"] == "quick" and data["note"] == bench.CPU_NOTE
    assert data["bf16_moe_baseline"] == "torch._grouped_mm" and data["goals"] == []
    assert len(data["linear"]) == 2 * 2 * 3 * 4  # models × matrices × kernels × token counts
    for row in data["linear"]:
        size = {"mxfp4_linear": bench.mxfp4_bytes(row["out_features"], row["in_features"])}.get(row["kernel"])
        assert size is None or row["weight_bytes"] == size
        assert row["flops"] == bench.linear_flops(row["tokens"], row["out_features"], row["in_features"])
        assert row["ms"] > 0 and row["gbs"] > 0 and row["ratio"] > 0 and row["hbm_fraction"] is None
    assert [m["tokens"] for m in data["moe"]] == [1, 4, 16, 32] * 2
    for row in data["moe"]:
        assert 1 <= row["experts_routed"] <= min(row["experts"], row["tokens"] * row["top_k"])
        shape = bench.MoEShape("", row["hidden"], row["experts"], row["intermediate"], row["top_k"])
        assert row["weight_bytes"] == bench.moe_weight_bytes(shape, row["experts_routed"])
        assert row["kernels_ms"] is None and row["bf16_ms"] > 0 and row["routing_ms"] > 0
    assert len(data["golomb_rice"]) == 4 and all(d["matches_reference"] for d in data["golomb_rice"])


def test_command_refuses_a_json_path_in_a_missing_directory(tmp_path):
    from moecompress.cli.main import app

    with pytest.raises(UserInputError, match="directory does not exist"):
        app.main(["bench", "kernels", "--json-out", str(tmp_path / "no" / "k.json")], standalone_mode=False)
