"""Routing-replay QAT: replayed routes reach the experts, the router stays bit-identical, adapters train, the
output reloads to the reported numbers, and bad options are refused."""

import itertools
import json

import pytest
import torch
from helpers import run_cli, tree_hashes

from moecompress.errors import UserInputError
from moecompress.evals.perplexity import evaluate
from moecompress.families.routing import RoutingRule
from moecompress.loading import load_adapter, load_model
from moecompress.passes.qat import QATConfig, qat_checkpoint
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint
from moecompress.training.loop import TrainingConfig, lr_factor, prepare_student, train_adapters
from moecompress.training.replay import ReplaySchedule


@pytest.mark.parametrize(
    "rule",
    [
        RoutingRule("softmax_topk", top_k=2),
        RoutingRule("softmax_topk", top_k=2, normalize=False),
        RoutingRule("topk_softmax", top_k=2),
        RoutingRule("topk_sigmoid", top_k=2, scales_input=True),
        RoutingRule("sigmoid_group_topk", top_k=2, scaling=2.5, n_group=2, topk_group=1),
        RoutingRule("softmax_group_topk", top_k=2, normalize=False, n_group=2, topk_group=1),
        RoutingRule("softmax_bias_topk", top_k=2, norm_min=1e-12),
        RoutingRule("bias_topk_sigmoid", top_k=2),
        RoutingRule("bias_topk_sigmoid", top_k=2, normalize=False),
        RoutingRule("sparsemixer", top_k=2, jitter_eps=0.3),
    ],
)
def test_weights_for_the_chosen_ids_are_the_rules_own_weights(rule):
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    ids, weights = rule.route(logits)
    torch.testing.assert_close(rule.weights_for(logits, ids), weights)


def test_replay_schedule_parses_and_refuses():
    layers = [0, 1, 2, 3]
    assert ReplaySchedule.parse("all").layers_at(99, 100, layers) == set(layers)
    assert ReplaySchedule.parse("none").layers_at(0, 100, layers) == set()
    first = ReplaySchedule.parse("first:0.25")
    assert [bool(first.layers_at(step, 8, layers)) for step in range(8)] == [True] * 2 + [False] * 6
    assert ReplaySchedule.parse("layers:3,1").layers_at(50, 100, layers) == {1, 3}
    assert ReplaySchedule.parse("first:0.5").describe() == "first:0.5"
    for bad in ("some", "first:2", "first:x", "layers:", "layers:a"):
        with pytest.raises(UserInputError, match="replay schedule"):
            ReplaySchedule.parse(bad)
    with pytest.raises(UserInputError, match="not MoE layers"):
        ReplaySchedule.parse("layers:7").check_layers(layers)


def test_lr_warms_up_then_decays_to_zero():
    factors = [lr_factor(step, 100, 0.1) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(b <= a for a, b in itertools.pairwise(factors[9:])) and factors[-1] < 0.01


@pytest.fixture(scope="module")
def ptq(tiny_with_tokenizer, tmp_path_factory):
    """A tiny Qwen3-MoE teacher and its INT2 + rank-2 adapters PTQ checkpoint."""
    source = tiny_with_tokenizer["qwen3_moe"]
    out = tmp_path_factory.mktemp("qat") / "ptq"
    quantize_checkpoint(
        source, out, QuantizeConfig(scheme="int2", lowrank_rank=2), calib_tokens=1024, seq_len=32, progress=False
    )
    return source, out


def _models(ptq):
    source, quantized = ptq
    teacher_adapter, student_adapter = load_adapter(source), load_adapter(quantized)
    teacher, student = load_model(source, teacher_adapter), load_model(quantized, student_adapter)
    return teacher, teacher_adapter, student, student_adapter


def _experts_inputs(model, adapter):
    """Per forward, the top-k ids each MoE layer's experts module was called with."""
    seen = []
    for layer in adapter.moe_layers():
        adapter.experts_of(model, layer).register_forward_pre_hook(
            lambda module, args, layer=layer: seen.append((layer, args[1].clone()))
        )
    return seen


def _teacher_routes(model, adapter):
    seen = []
    for layer in adapter.moe_layers():
        adapter.router_of(model, layer).register_forward_hook(
            lambda module, args, output, layer=layer: seen.append((layer, output[2].clone()))
        )
    return seen


@pytest.mark.parametrize("replay_weights", ["router", "recorded"])
def test_with_replay_the_experts_get_the_recorded_routes_and_the_router_stays_bit_identical(ptq, replay_weights):
    teacher, teacher_adapter, student, student_adapter = _models(ptq)
    trainable = prepare_student(student, torch.float32)
    frozen = {name: p.detach().clone() for name, p in student.named_parameters() if ".lowrank." not in name}
    adapters = {name: p.detach().clone() for name, p in student.named_parameters() if ".lowrank." in name}
    assert trainable and len(adapters) == len(trainable)
    assert any(".mlp.gate." in name for name in frozen)
    recorded = _teacher_routes(teacher, teacher_adapter)
    used = _experts_inputs(student, student_adapter)
    windows = torch.randint(0, 384, (6, 32), generator=torch.Generator().manual_seed(0))
    config = TrainingConfig(steps=3, batch_size=2, lr=1e-2, replay=ReplaySchedule(1.0), replay_weights=replay_weights)
    log = train_adapters(student, student_adapter, teacher, teacher_adapter, windows, config, trainable, False)
    assert len(used) == len(recorded) == 3 * len(student_adapter.moe_layers())
    for (layer_used, ids_used), (layer_recorded, ids_recorded) in zip(used, recorded, strict=True):
        assert layer_used == layer_recorded
        assert torch.equal(ids_used, ids_recorded)
    assert log.own_route_agreement[0] < 1.0  # the student's own router would have chosen differently
    after = dict(student.named_parameters())
    for name, before in frozen.items():
        assert torch.equal(after[name], before), name
    assert any(not torch.equal(after[name], before) for name, before in adapters.items())
    assert len(log.loss) == 3 and all(r == len(student_adapter.moe_layers()) for r in log.replayed_layers)


def test_without_replay_the_experts_get_the_students_own_routes(ptq):
    teacher, teacher_adapter, student, student_adapter = _models(ptq)
    trainable = prepare_student(student, torch.float32)
    own = _teacher_routes(student, student_adapter)  # the student's own router output, before any replay hook
    used = _experts_inputs(student, student_adapter)
    windows = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(1))
    config = TrainingConfig(steps=2, batch_size=2, replay=ReplaySchedule(0.0))
    log = train_adapters(student, student_adapter, teacher, teacher_adapter, windows, config, trainable, False)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(used, own, strict=True))
    assert log.replayed_layers == [0, 0]


def test_qat_command_writes_a_checkpoint_that_reloads_to_the_reported_perplexity(tiny_with_tokenizer, tmp_path):
    source = tiny_with_tokenizer["qwen3_moe"]
    before = tree_hashes(source)
    out = tmp_path / "qat"
    result = run_cli(
        "qat", str(source), "--out", str(out), "--scheme", "int2", "--steps", "4", "--batch-size", "2",
        "--seq-len", "32", "--train-tokens", "512", "--calib-tokens", "1024", "--eval-tokens", "512",
        "--replay", "first:0.5", "--lr", "1e-2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "routing agreement" in result.stdout and "(PTQ)" in result.stdout
    assert tree_hashes(source) == before
    report = json.loads((out / "moecompress_report.json").read_text())
    assert report["pass"] == "qat" and report["qat"]["replayed_layers"][:2] == [2, 2]
    assert report["qat"]["replayed_layers"][2:] == [0, 0]
    assert report["footprint"]["classes"]["experts"]["adapter_bytes"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "moecompress"
    again = evaluate(out, "builtin:prose", seq_len=32, max_tokens=512, reference_dir=source, progress=False)
    assert again.perplexity == pytest.approx(report["eval"]["after"]["perplexity"], rel=1e-6)
    assert again.routing_agreement == pytest.approx(report["eval"]["after"]["routing_agreement"], rel=1e-6)
    assert report["eval"]["before"]["perplexity"] != report["eval"]["after"]["perplexity"]


def test_qat_refuses_a_bad_replay_with_one_line_and_exit_2(tiny_with_tokenizer, tmp_path):
    out = tmp_path / "qat"
    result = run_cli(
        "qat", str(tiny_with_tokenizer["qwen3_moe"]), "--out", str(out), "--scheme", "int2", "--replay", "x"
    )
    assert result.returncode == 2
    assert "--replay" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (QATConfig(replay="layers:9"), "not MoE layers"),
        (QATConfig(quantize=QuantizeConfig(scheme="int2", lowrank_rank=2, lowrank_budget=0.5)), "not both"),
        (QATConfig(quantize=QuantizeConfig(scheme="int2")), "adapters"),
        (QATConfig(quantize=QuantizeConfig(scheme="int2", lowrank_rank=2, format="gpt-oss")), "native"),
        (QATConfig(steps=0), "--steps"),
        (QATConfig(replay_weights="teacher"), "--replay-weights"),
    ],
)
def test_qat_refuses_bad_configs_before_writing(tiny_with_tokenizer, tmp_path, config, message):
    with pytest.raises(UserInputError, match=message):
        qat_checkpoint(tiny_with_tokenizer["qwen3_moe"], tmp_path / "q", config, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_the_ptq_intermediate_is_partial_work_of_the_output_and_is_removed(tiny_with_tokenizer, tmp_path, monkeypatch):
    """While qat trains, its PTQ checkpoint lies in the output's hidden run directory, which the partial-work check
    (``--resume``/``--restart``) knows; a finished run leaves nothing beside the output."""
    from moecompress.passes import qat
    from moecompress.runner.preflight import partial_work

    out, seen = tmp_path / "q", []
    real = qat.train_adapters

    def train(*args, **kwargs):
        seen.append((partial_work(out), sorted(p.name for p in (tmp_path / ".q.run").iterdir())))
        return real(*args, **kwargs)

    monkeypatch.setattr(qat, "train_adapters", train)
    quantize = QuantizeConfig(scheme="int2", lowrank_rank=2)
    config = QATConfig(quantize=quantize, steps=1, batch_size=2, seq_len=32, train_tokens=128)
    qat_checkpoint(tiny_with_tokenizer["qwen3_moe"], out, config, calib_tokens=256, eval_data=None, progress=False)
    assert seen == [([tmp_path / ".q.run"], ["qat-ptq"])]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]
