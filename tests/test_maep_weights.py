"""MAEP's Fisher token weights: s_t = ‖∂loss/∂y_t‖² / H at every MoE block output, and the score they give,
mean over tokens of s_t ‖ΔH_t‖², both computed here independently of the pass."""

import pytest
import torch
import torch.nn.functional as F

from moecompress.checkpoint import resolve_model
from moecompress.loading import load_adapter, load_model
from moecompress.passes.expert_scores import brute_force_delta_h
from moecompress.passes.maep_weights import maep_token_weights
from moecompress.passes.prune_experts import PruneExpertsConfig, score_layer
from moecompress.sweep.engine import LayerCapture


def _batches():
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 2048, (2, 32), generator=generator)} for _ in range(2)]


def test_token_weights_are_the_squared_loss_gradient_at_each_block_output(tmp_path, monkeypatch):
    model_dir = resolve_model("builtin:tiny-moe")
    batches = _batches()
    weights = maep_token_weights(model_dir, batches, state_dir=tmp_path, progress=False)

    model = load_model(model_dir, load_adapter(model_dir))
    gradients = {layer: [] for layer in range(len(model.model.layers))}
    for layer, module in enumerate(model.model.layers):

        def keep(_module, _args, output, layer=layer):
            output.register_hook(lambda grad: gradients[layer].append(grad.reshape(-1, grad.shape[-1])))

        module.mlp.register_forward_hook(keep)
    for batch in batches:
        ids = batch["input_ids"]
        logits = model(input_ids=ids).logits.float()
        F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        ).backward()
    assert sorted(weights) == sorted(gradients)
    for layer, pieces in gradients.items():
        expected = torch.cat(pieces).pow(2).mean(dim=-1)
        torch.testing.assert_close(weights[layer], expected, rtol=1e-3, atol=1e-9)
        assert expected.max() > 0

    def no_second_backward(*args, **kwargs):
        raise AssertionError("a resumed run recomputes the weights")

    monkeypatch.setattr("moecompress.passes.maep_weights.block_output_fisher", no_second_backward)
    again = maep_token_weights(model_dir, batches, state_dir=tmp_path, progress=False)
    assert all(torch.equal(again[layer], weights[layer]) for layer in weights)
    with pytest.raises(AssertionError, match="recomputes"):
        maep_token_weights(model_dir, batches[:1], state_dir=tmp_path, progress=False)


def _tiny_layer():
    from moecompress.families import MoEWeights
    from moecompress.families.qwen_moe import Qwen3MoeAdapter

    hidden_size, inter, experts = 8, 4, 6
    adapter = Qwen3MoeAdapter(
        {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 1,
            "num_experts": experts,
            "num_experts_per_tok": 2,
            "hidden_size": hidden_size,
            "num_attention_heads": 2,
            "norm_topk_prob": True,
        }
    )
    generator = torch.Generator().manual_seed(3)
    moe = MoEWeights(
        router_weight=torch.randn(experts, hidden_size, generator=generator),
        gate_up=torch.randn(experts, 2 * inter, hidden_size, generator=generator),
        down=torch.randn(experts, hidden_size, inter, generator=generator),
        expert_ids=list(range(experts)),
    )
    x = torch.randn(400, hidden_size, generator=generator)
    capture = LayerCapture(layer=0, moe=moe, moe_input=x, tags=torch.zeros(400, dtype=torch.long), tag_names=["t"])
    return adapter, capture


def test_fisher_weighted_maep_is_the_weighted_mean_of_squared_delta_h():
    adapter, capture = _tiny_layer()
    weight = torch.rand(capture.moe_input.shape[0], generator=torch.Generator().manual_seed(4))
    delta_h = brute_force_delta_h(adapter, capture.moe, capture.moe_input)
    scores = score_layer(adapter, capture, PruneExpertsConfig(), weight)
    torch.testing.assert_close(scores.score, (weight[:, None] * delta_h.pow(2)).mean(dim=0), rtol=1e-5, atol=1e-6)
    assert scores.extra["token_weight"] == "fisher"
    plain = score_layer(adapter, capture, PruneExpertsConfig(token_weight="none"))
    torch.testing.assert_close(plain.score, delta_h.pow(2).mean(dim=0), rtol=1e-5, atol=1e-6)
    assert plain.extra["token_weight"] == "none"


def test_tokens_that_cost_nothing_downstream_do_not_keep_an_expert():
    """The most used expert scores zero once the tokens routed to it weigh nothing, and becomes the first removed."""
    adapter, capture = _tiny_layer()
    plain = score_layer(adapter, capture, PruneExpertsConfig(token_weight="none"))
    busiest = int(plain.frequency.argmax())
    ids, _ = adapter.route(capture.moe, adapter.router_logits(capture.moe, capture.moe_input))
    weight = torch.where((ids == busiest).any(dim=-1), 0.0, 1.0)
    weighted = score_layer(adapter, capture, PruneExpertsConfig(), weight)
    assert plain.score[busiest] > plain.score.min()
    assert weighted.score[busiest] == 0
    assert int(weighted.score.argmin()) == busiest
