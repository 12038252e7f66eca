"""DBRX: the release's [E * I, H] expert parameters in the view, the FFN's p-norm routing, rerouting where the experts
module receives the choice, and a replayed route passed through the router's logits."""

import re

import pytest
import torch
from helpers import model_layer_split, run_cli
from synthetic import TINY_CONFIGS, build_tiny_model
from transformers import AutoModelForCausalLM

from moecompress.errors import UserInputError
from moecompress.families import adapter_for

E, INTER, H = 8, 32, 64


def _model(**ffn):
    """The tiny DBRX model, with ``ffn_config`` entries changed by ``ffn``."""
    if not ffn:
        return build_tiny_model("dbrx")
    from transformers import AutoConfig

    kwargs = {k: v for k, v in TINY_CONFIGS["dbrx"].items() if k != "model_type"}
    kwargs["ffn_config"] = {**kwargs["ffn_config"], **ffn}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("dbrx", **kwargs), dtype=torch.float32).eval()


def _tokens(count=48):
    return torch.randn(1, count, H, generator=torch.Generator().manual_seed(1))


def test_the_release_parameters_are_the_view_and_written_back_unchanged():
    adapter, moe, rest, layout, tensors = model_layer_split(build_tiny_model("dbrx"))
    experts = "transformer.blocks.0.ffn.experts.mlp."
    w1, v1, w2 = (tensors[experts + name].view(E, INTER, H) for name in ("w1", "v1", "w2"))
    assert tensors[experts + "w1"].shape == (E * INTER, H)
    assert torch.equal(moe.gate_up[:, :INTER], w1) and torch.equal(moe.gate_up[:, INTER:], v1)
    assert torch.equal(moe.down, w2.transpose(1, 2))
    assert torch.equal(moe.router_weight, tensors["transformer.blocks.0.ffn.router.layer.weight"])
    joined = adapter.join_layer(0, moe, rest, layout)
    assert joined.keys() == tensors.keys() and all(torch.equal(joined[k], tensors[k]) for k in tensors)
    assert adapter.classify_key("transformer.blocks.0.norm_attn_norm.norm_1.weight") == "norms"
    assert adapter.classify_key("transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight") == "attention"
    assert adapter.classify_key("transformer.wte.weight") == "embeddings"


def test_a_wrong_expert_count_is_refused_with_the_tensor_named():
    adapter, _, _, _, tensors = model_layer_split(build_tiny_model("dbrx"))
    key = "transformer.blocks.0.ffn.experts.mlp.v1"
    tensors[key] = tensors[key][: (E - 1) * INTER]
    with pytest.raises(UserInputError, match=re.escape("mlp.v1: shape [224, 64], config.json implies [256, 64]")):
        adapter.split_layer(0, tensors)


@pytest.mark.parametrize("p", [1.0, 2.0, None])
def test_the_view_routes_and_computes_as_the_stock_ffn(p):
    model = _model(moe_normalize_expert_weights=p)
    adapter, moe, _, _, _ = model_layer_split(model)
    hidden = _tokens()
    ffn = model.transformer.blocks[0].ffn
    stock_weights, stock_ids = ffn.route_tokens_to_experts(ffn.router(hidden))
    _, weights, ids = adapter.stock_route(model, 0, hidden[0])
    assert torch.equal(ids, stock_ids) and torch.equal(weights, stock_weights)
    view_ids, view_weights = adapter.route(moe, adapter.router_logits(moe, hidden[0]))
    assert torch.equal(view_ids, ids)
    torch.testing.assert_close(view_weights, weights, rtol=0, atol=1e-7)
    if p == 2.0:  # the 2-norm is not the sum's renormalisation
        assert (view_weights.sum(-1) - 1).abs().max() > 1e-2
    with torch.no_grad():
        torch.testing.assert_close(adapter.moe_forward(moe, hidden[0]), ffn(hidden)[0], rtol=0, atol=1e-6)
        stock = adapter.stock_experts(model, 0, hidden[0], ids, weights)
    assert stock.shape == hidden[0].shape


def test_rerouting_equals_the_model_with_the_removed_experts_deleted():
    model = build_tiny_model("dbrx")
    adapter, moe, rest, layout, _ = model_layer_split(model)
    keep = [0, 2, 3, 6]
    allowed = torch.zeros(E, dtype=torch.bool)
    allowed[keep] = True
    hidden = _tokens()
    with torch.no_grad():
        free = model.transformer.blocks[0].ffn(hidden)
    handles = adapter.reroute_hooks(model.transformer.blocks[0], lambda logits: adapter.route(moe, logits, allowed))
    with torch.no_grad():
        rerouted = model.transformer.blocks[0].ffn(hidden)
    for handle in handles:
        handle.remove()
    pruned = _model(moe_num_experts=len(keep))
    prefix = adapter.layer_prefix(0)
    joined = adapter.join_layer(0, moe.select(keep), rest, layout)
    pruned.transformer.blocks[0].load_state_dict({k[len(prefix) :]: v for k, v in joined.items()}, strict=True)
    with torch.no_grad():
        deleted = pruned.transformer.blocks[0].ffn(hidden)
    torch.testing.assert_close(rerouted, deleted, rtol=0, atol=1e-6)
    assert (rerouted - free).abs().max() > 1e-3


def test_a_replayed_route_passes_through_the_router_logits():
    model = build_tiny_model("dbrx")
    adapter, moe, _, _, _ = model_layer_split(model)
    allowed = torch.ones(E, dtype=torch.bool)
    allowed[[1, 4, 5]] = False
    ffn = model.transformer.blocks[0].ffn
    hidden = _tokens()

    def replay(router, inputs, output):
        ids, weights = adapter.route(moe, output, allowed)
        return adapter.with_route(output, weights, ids)

    handle = ffn.router.register_forward_hook(replay)
    with torch.no_grad():
        replayed = ffn(hidden)
        ids = adapter.route_of(ffn.router(hidden))[2]
    handle.remove()
    assert not torch.isin(ids, torch.tensor([1, 4, 5])).any()
    want_ids, want_weights = adapter.route(moe, adapter.router_logits(moe, hidden[0]), allowed)
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    with torch.no_grad():
        want = adapter.stock_experts(model, 0, hidden[0], want_ids, want_weights)
    torch.testing.assert_close(replayed[0], want, rtol=0, atol=1e-6)
    plain = adapter_for(_model(moe_normalize_expert_weights=None).config.to_dict())
    with pytest.raises(UserInputError, match="moe_normalize_expert_weights null"):
        plain.with_route(torch.zeros(2, E), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long))


def test_pruned_config_keeps_the_count_in_ffn_config():
    adapter = adapter_for(build_tiny_model("dbrx").config.to_dict())
    config = adapter.with_expert_counts({0: 4, 1: 4}, {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]})
    assert config["ffn_config"]["moe_num_experts"] == 4 and "moe_num_experts" not in config
    pruned = adapter_for(config)
    assert pruned.num_experts == 4 and pruned.original_expert_ids(1) == [4, 5, 6, 7]
    uneven = adapter_for(adapter.with_expert_counts({0: 4, 1: 6}, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3, 4, 5]}))
    assert uneven.experts_in_layer(0) == 4 and uneven.experts_in_layer(1) == 6


def test_global_scope_is_one_line_exit_2_before_work(tiny_checkpoints, tmp_path):
    out = tmp_path / "pruned"
    result = run_cli("prune", str(tiny_checkpoints["dbrx"]), "--out", str(out), "--ratio", "0.3", "--scope", "global")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "dbrx keeps its expert count in ffn_config" in result.stderr and not out.exists()


def test_qat_without_renormalised_weights_is_one_line_exit_2_before_work(tiny_checkpoints, tmp_path):
    """DBRX's route replay passes weights through the router's logits, which needs their p-norm to be 1."""
    import json
    import shutil

    model = tmp_path / "dbrx"
    shutil.copytree(tiny_checkpoints["dbrx"], model)
    config = json.loads((model / "config.json").read_text())
    config["ffn_config"]["moe_normalize_expert_weights"] = None
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "qat"
    result = run_cli("qat", str(model), "--out", str(out), "--scheme", "mxfp4")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "QAT's route replay cannot run" in result.stderr and not out.exists()
