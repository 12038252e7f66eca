"""DeepSeek-V4: the release's names, sqrt-softplus routing, the clamped SwiGLU, hash-routed layers (their token-id
table in the view, rewritten by pruning and merging)."""

import json

import pytest
import torch
from helpers import assert_view_computes_the_stock_layer, checkpoint_adapter, copy_with_tokenizer, load_stock
from synthetic import TINY_CONFIGS, tiny_config

from moecompress.checkpoint import CheckpointReader
from moecompress.checkpoint.stream import group_keys_by_layer
from moecompress.errors import UserInputError
from moecompress.families import MoEWeights, adapter_for
from moecompress.families.token_table import merged, table_route


def test_hash_layers_are_in_the_view_and_the_release_count_is_read():
    adapter = adapter_for(tiny_config("deepseek_v4").to_dict())
    assert adapter.moe_layers() == [0, 1, 2] and [adapter.hash_layer(layer) for layer in range(3)] == [
        True,
        False,
        False,
    ]
    legacy = {k: v for k, v in TINY_CONFIGS["deepseek_v4"].items() if k != "mlp_layer_types"}
    adapter = adapter_for({**legacy, "num_hidden_layers": 4, "num_hash_layers": 2})
    assert adapter.moe_layers() == [0, 1, 2, 3] and adapter.mlp_kinds() == ["hash_moe", "hash_moe", "moe", "moe"]


def test_the_release_layout_loads_in_stock_transformers_with_its_int32_table(tiny_checkpoints):
    directory = tiny_checkpoints["deepseek_v4"]
    with CheckpointReader(directory) as reader:
        keys = set(reader.keys())
        assert {"embed.weight", "head.weight", "hc_head_fn", "layers.1.ffn.gate.bias"} <= keys
        assert reader.read(["layers.0.ffn.gate.tid2eid"])["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    model = load_stock(directory)
    table = model.model.layers[0].mlp.gate.tid2eid
    assert len({tuple(row) for row in table.tolist()}) > 1 and (table < 8).all()


def test_routing_and_activation_equal_the_stock_router_and_experts(tiny_checkpoints):
    directory = tiny_checkpoints["deepseek_v4"]
    adapter = checkpoint_adapter(directory)
    model = load_stock(directory)
    hidden = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    assert_view_computes_the_stock_layer(adapter, model, 1, _layer(directory, 1), hidden)
    clamped = adapter.activation(torch.full((1,), 20.0), torch.full((1,), -20.0))
    assert torch.equal(clamped, torch.nn.functional.silu(torch.full((1,), 10.0)) * -10.0)


def test_global_scope_is_refused_in_one_line(tiny_checkpoints, tmp_path):
    from moecompress import api

    with pytest.raises(UserInputError, match=r"one expert count in every layer.*scope=.?layer") as info:
        api.prune(tiny_checkpoints["deepseek_v4"], tmp_path / "out", keep=4, scope="global", evaluation=None)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def _block(table):
    """Five experts whose router rows lie on a line (0, 1, 10, 11) and off it (4), hash-routed by ``table``."""
    router = torch.tensor([[0.0, 0.0], [1.0, 0.0], [10.0, 0.0], [11.0, 0.0], [0.0, 5.0]])
    return MoEWeights(
        router_weight=router,
        gate_up=torch.zeros(5, 4, 2),
        down=torch.zeros(5, 2, 2),
        expert_ids=list(range(5)),
        token_table=table,
    )


def test_select_sends_a_removed_experts_rows_to_the_closest_kept_expert_not_in_the_row_and_renumbers():
    table = torch.tensor([[0, 2], [2, 3], [3, 1], [4, 0]], dtype=torch.int32)
    kept = _block(table).select([4, 0, 1])
    # 2 and 3 go: both are closest to 1, then 0; a row that already names 1 takes 0. New positions: 4, 0, 1 -> 0, 1, 2
    assert kept.token_table.dtype == torch.int32
    assert kept.token_table.tolist() == [[1, 2], [2, 1], [1, 2], [0, 1]]
    assert kept.expert_ids == [4, 0, 1]
    allowed = torch.tensor([True, True, False, False, True])
    ids = torch.arange(4)
    assert table_route(table, _block(table).router_weight, ids, allowed).tolist() == [[0, 1], [1, 0], [0, 1], [4, 0]]


def test_merging_sends_each_members_rows_to_its_group():
    table = torch.tensor([[0, 2], [2, 3], [3, 1], [4, 0]], dtype=torch.int32)
    assert merged(table, _block(table).router_weight, [[0, 1], [2, 3], [4]]).tolist() == [
        [0, 1],
        [1, 1],
        [1, 0],
        [2, 0],
    ]


@pytest.fixture(scope="module")
def with_tokenizer(tiny_checkpoints, tmp_path_factory):
    return copy_with_tokenizer(tiny_checkpoints["deepseek_v4"], tmp_path_factory.mktemp("deepseek_v4") / "source")


def _layer(directory, layer):
    adapter = checkpoint_adapter(directory)
    with CheckpointReader(directory) as reader:
        keys, _ = group_keys_by_layer(reader, adapter)
        return adapter.split_layer(layer, reader.read(keys[layer]))[0]


def test_calibration_counts_what_the_table_sends(with_tokenizer):
    from moecompress.passes.expert_scores import brute_force_delta_h, layer_expert_stats
    from moecompress.sweep.engine import CalibrationSweep

    ids = torch.randint(3, 384, (2, 32), generator=torch.Generator().manual_seed(1))
    sweep = CalibrationSweep(with_tokenizer, [{"input_ids": ids}], torch.zeros(64, dtype=torch.long), ["text"])
    captures = {}
    for capture in sweep.run():
        captures[capture.layer] = (capture.moe, capture.moe_input, capture.token_ids)
    moe, hidden, token_ids = captures[0]
    assert torch.equal(token_ids, ids.reshape(-1)) and captures[1][2] is None
    adapter = sweep.adapter
    stats = layer_expert_stats(adapter, moe, hidden, token_ids=token_ids)
    sent = torch.bincount(moe.token_table[ids.reshape(-1)].long().reshape(-1), minlength=moe.num_experts)
    assert torch.equal(stats.routed_counts, sent.float())
    torch.testing.assert_close(stats.delta_h, brute_force_delta_h(adapter, moe, hidden, token_ids=token_ids))
    stock = load_stock(with_tokenizer).model.layers[0].mlp.gate
    stock.tid2eid = moe.token_table.long()
    _, weights, chosen = stock(hidden, ids.reshape(-1))
    view_ids, view_weights = adapter.route(moe, adapter.router_logits(moe, hidden), token_ids=token_ids)
    assert torch.equal(view_ids, chosen) and torch.equal(view_weights, weights)


def _masked_logits(source, removed, ids):
    """The input's logits with each layer's ``removed`` experts (original ids) routed around as the sweep does."""
    adapter, model = checkpoint_adapter(source), load_stock(source)
    for layer, experts in removed.items():
        moe = _layer(source, layer)
        allowed = torch.ones(moe.num_experts, dtype=torch.bool)
        allowed[experts] = False

        def choose(logits, moe=moe, allowed=allowed, token_ids=None):
            return adapter.route(moe, logits, allowed, token_ids)

        adapter.reroute_hooks(adapter.decoder_layers(model)[layer], choose)
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_prune_rewrites_the_table_and_stock_transformers_computes_the_masked_input_exactly(with_tokenizer, tmp_path):
    import transformers

    from moecompress import api

    out = tmp_path / "pruned"
    result = api.prune(with_tokenizer, out, keep=4, scope="layer", calibration={"tokens": 512, "seq_len": 64})
    report = json.loads((out / "moecompress_report.json").read_text())
    removed = {int(layer): entry["removed"] for layer, entry in report["layers"].items()}
    assert sorted(removed) == [0, 1, 2] and all(len(experts) == 4 for experts in removed.values())
    _, loading = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    original = _layer(with_tokenizer, 0)
    kept = [expert for expert in range(8) if expert not in removed[0]]
    written = _layer(out, 0).token_table
    assert torch.equal(written, original.select(kept).token_table) and written.dtype == torch.int32
    assert int(written.max()) < 4 and all(len(set(row)) == 2 for row in written.tolist())
    ids = torch.randint(3, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    redirected = torch.isin(original.token_table[ids.reshape(-1)], torch.tensor(removed[0])).any(dim=1)
    assert redirected.sum() > 0, "no test token's row names a removed expert"
    with torch.no_grad():
        pruned = load_stock(out)(input_ids=ids).logits
    assert torch.equal(pruned, _masked_logits(with_tokenizer, removed, ids))
    assert result.report["eval"]["perplexity"] > 0


def test_merge_sends_the_merged_experts_rows_to_their_target(with_tokenizer, tmp_path):
    from moecompress import api

    out = tmp_path / "merged"
    api.prune(
        with_tokenizer, out, keep=4, scope="layer", method="merge", calibration={"tokens": 512, "seq_len": 64},
        evaluation=None,
    )  # fmt: skip
    report = json.loads((out / "moecompress_report.json").read_text())
    groups = [group["members"] for group in report["layers"]["0"]["merge_groups"]]
    original = _layer(with_tokenizer, 0)
    assert torch.equal(_layer(out, 0).token_table, merged(original.token_table, original.router_weight, groups))
    model = load_stock(out)
    assert model.model.layers[0].mlp.experts.down_proj.shape[0] == 4
    ids = torch.randint(3, 384, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_mxfp4_quantises_every_layer_and_keeps_the_hash_layers_table(tiny_checkpoints, tmp_path):
    import moecompress  # noqa: F401 - the plugin
    from moecompress import api

    source, out = tiny_checkpoints["deepseek_v4"], tmp_path / "mxfp4"
    api.quantize(source, out, scheme="mxfp4", evaluation=None)
    adapter = checkpoint_adapter(out)
    model = load_stock(out)
    table = model.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(table, load_stock(source).model.layers[0].mlp.gate.tid2eid.to(table.dtype))
    assert {type(adapter.experts_of(model, layer)).__name__ for layer in (0, 1, 2)} == {"QuantizedExperts"}
    ids = torch.randint(3, 384, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
