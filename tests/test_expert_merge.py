"""Expert merging: the merged expert is its defined combination (recomputed here independently), alignment undoes a
permutation of neurons, the refit lowers the group's output error, and the clustering tree cuts as asked."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_expert_scores import _layer_view

from moecompress.errors import UserInputError
from moecompress.passes.expert_merge import cut_tree, expert_signatures, merge_experts, merge_tree

FAMILIES = [
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "deepseek_v3",
    "llama4",
    "nemotron_h",
    "gemma4",
    "longcat_flash",
    "bailing_hybrid",
]


def _tokens(moe, count, seed=0):
    return torch.randn(count, moe.router_weight.shape[1], generator=torch.Generator().manual_seed(seed))


def _groups(num_experts):
    if num_experts == 4:
        return [[0, 3], [1], [2]]
    return [[0, 7], [1], [2, 3, 5], [4], [6]]


def _greedy_by_sorting(similarity):
    """Greedy matching, walked pair by pair in order of decreasing similarity (ties: row-major order)."""
    count = similarity.shape[0]
    match, used_rows, used_cols = [-1] * count, set(), set()
    for flat in torch.sort(similarity.flatten(), descending=True, stable=True).indices.tolist():
        row, col = divmod(flat, count)
        if row not in used_rows and col not in used_cols:
            match[row] = col
            used_rows.add(row)
            used_cols.add(col)
    return torch.tensor(match)


def _permute(moe, expert, order):
    """Expert ``expert``'s tensors with its intermediate neurons taken in ``order``."""
    inter = moe.intermediate_size
    rows = torch.cat([order, order + inter]) if moe.gated else order
    out = {"gate_up": moe.gate_up[expert][rows], "down": moe.down[expert][:, order]}
    if moe.gate_up_bias is not None:
        out["gate_up_bias"] = moe.gate_up_bias[expert][rows]
    if moe.down_bias is not None:
        out["down_bias"] = moe.down_bias[expert]
    return out


def _reference(adapter, moe, members, hidden, refit):
    """The merged expert by its definition, computed on all tokens at once: ``(tensors, router rows, anchor)``."""
    rule = adapter.routing_rule()
    ids, weights = adapter.route(moe, adapter.router_logits(moe, hidden))
    counts = torch.bincount(ids.reshape(-1), minlength=moe.router_columns)[: moe.num_experts].double()
    member_counts = counts[members]
    anchor = members[int(torch.argmax(member_counts))]  # the first maximum
    total = member_counts.sum()
    share = (member_counts / total if total > 0 else torch.full_like(member_counts, 1 / len(members))).float()
    in_group = torch.isin(ids, torch.tensor(members))
    rows = in_group.any(1)
    x, mask, group_ids, group_weights = hidden[rows], in_group[rows], ids[rows], weights[rows]
    merged_input = x
    if rule.scales_input:
        merged_input = x * ((group_weights * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True))
    inter = moe.intermediate_size

    def intermediate(gate_up, bias):
        return adapter.expert_hidden(F.linear(merged_input, gate_up, bias), inter, moe.layer)

    bias_of = (lambda e: moe.gate_up_bias[e]) if moe.gate_up_bias is not None else (lambda e: None)
    anchor_act = intermediate(moe.gate_up[anchor], bias_of(anchor))
    aligned = []
    for member in members:
        if member == anchor:
            order = torch.arange(inter)
        elif x.shape[0] >= inter:
            act = intermediate(moe.gate_up[member], bias_of(member))
            order = _greedy_by_sorting(torch.corrcoef(torch.cat([anchor_act, act], 1).T.double())[:inter, inter:])
        else:
            order = _greedy_by_sorting(_weight_cosine(moe, anchor, member))
        aligned.append(_permute(moe, member, order))
    tensors = {name: sum(s * part[name] for s, part in zip(share, aligned, strict=True)) for name in aligned[0]}
    routers = {
        name: sum(s * getattr(moe, name)[m] for s, m in zip(share, members, strict=True))
        for name in ("router_weight", "router_bias", "correction_bias", "expert_scale")
        if getattr(moe, name) is not None
    }
    if refit:
        activation = intermediate(tensors["gate_up"], tensors.get("gate_up_bias")).double()
        if moe.down_bias is not None:
            activation = torch.cat([activation, torch.ones(activation.shape[0], 1, dtype=torch.float64)], 1)
        output_weight = rule.output_weight(group_weights) * mask
        target = _group_output(adapter, moe, x, group_ids, group_weights, mask)
        scaled = activation * output_weight.sum(1, keepdim=True).double()
        gram = scaled.T @ scaled
        ridge = torch.zeros(gram.shape[0], dtype=torch.float64)
        ridge[:inter] = 1e-4 * torch.trace(gram[:inter, :inter]) / inter
        solved = torch.linalg.solve(gram + torch.diag(ridge), scaled.T @ target)
        tensors["down"] = solved[:inter].T.float()
        if moe.down_bias is not None:
            tensors["down_bias"] = solved[inter].float()
    return tensors, routers, anchor


def _weight_cosine(moe, anchor, member):
    def features(e):
        inter = moe.intermediate_size
        parts = [moe.gate_up[e].reshape(-1, inter, moe.gate_up.shape[-1]).permute(1, 0, 2).reshape(inter, -1)]
        parts.append(moe.down[e].T)
        if moe.gate_up_bias is not None:
            parts.append(moe.gate_up_bias[e].reshape(-1, inter).T)
        return F.normalize(torch.cat(parts, 1).double(), dim=1)

    return features(anchor) @ features(member).T


@pytest.mark.parametrize("refit", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_merged_expert_equals_its_definition(family, refit, tiny_checkpoints):
    adapter, moe = _layer_view(tiny_checkpoints[family])
    hidden = _tokens(moe, 400)
    groups = _groups(moe.num_experts)
    merged, reports = merge_experts(adapter, moe, groups, hidden, refit=refit, chunk_tokens=96)
    assert merged.num_experts == len(groups) and merged.router_columns == len(groups) + moe.identity_experts
    assert [r["members"] for r in reports] == [[moe.expert_ids[m] for m in group] for group in groups]
    for position, (members, report) in enumerate(zip(groups, reports, strict=True)):
        if len(members) == 1:
            continue
        tensors, routers, anchor = _reference(adapter, moe, members, hidden, refit)
        assert merged.expert_ids[position] == report["anchor"] == moe.expert_ids[anchor]
        assert report["aligned_on"] == "activations" and report["refit"] == refit
        for name, expected in tensors.items():
            torch.testing.assert_close(getattr(merged, name)[position], expected, rtol=2e-4, atol=2e-5)
        for name, expected in routers.items():
            torch.testing.assert_close(getattr(merged, name)[position], expected, rtol=1e-6, atol=1e-7)
    if moe.identity_experts:
        assert torch.equal(merged.router_weight[len(groups) :], moe.router_weight[moe.num_experts :])
        assert torch.equal(merged.correction_bias[len(groups) :], moe.correction_bias[moe.num_experts :])


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "gemma4"])
def test_singletons_are_bit_identical(family, tiny_checkpoints):
    adapter, moe = _layer_view(tiny_checkpoints[family])
    order = list(reversed(range(moe.num_experts)))
    merged, reports = merge_experts(adapter, moe, [[e] for e in order], _tokens(moe, 200))
    expected = moe.select(order)
    for item in dataclasses.fields(moe):
        got, want = getattr(merged, item.name), getattr(expected, item.name)
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, item.name
    assert all(not r["refit"] and r["refit_skipped"] == "single expert" for r in reports)
    partial, _ = merge_experts(adapter, moe, _groups(moe.num_experts), _tokens(moe, 200))
    assert torch.equal(partial.gate_up[1], moe.gate_up[1]) and torch.equal(partial.down[1], moe.down[1])
    assert torch.equal(partial.router_weight[1], moe.router_weight[1])


def _with_copy(moe, source, target, order=None):
    """``moe`` with expert ``target`` (weights and router row) replaced by expert ``source`` (its neurons in
    ``order`` if given)."""
    order = torch.arange(moe.intermediate_size) if order is None else order
    changed = {}
    routers = {n: getattr(moe, n)[source] for n in ("router_weight", "router_bias") if getattr(moe, n) is not None}
    for name, tensor in {**_permute(moe, source, order), **routers}.items():
        full = getattr(moe, name).clone()
        full[target] = tensor
        changed[name] = full
    return dataclasses.replace(moe, **changed)


@pytest.mark.parametrize("tokens", [400, 8], ids=["activations", "weights"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4", "nemotron_h"])
def test_permuted_and_identical_experts_merge_back(family, tokens, tiny_checkpoints):
    adapter, moe = _layer_view(tiny_checkpoints[family])
    hidden = _tokens(moe, tokens)
    order = torch.randperm(moe.intermediate_size, generator=torch.Generator().manual_seed(3))
    for block in (_with_copy(moe, 0, 1), _with_copy(moe, 0, 1, order)):
        for refit in (False, True):
            merged, reports = merge_experts(adapter, block, [[0, 1]], hidden, refit=refit)
            report = reports[0]
            assert report["aligned_on"] == ("activations" if tokens >= moe.intermediate_size else "weights")
            anchor = block.expert_ids.index(report["anchor"])
            torch.testing.assert_close(merged.gate_up[0], block.gate_up[anchor], rtol=1e-6, atol=1e-6)
            if block.gate_up_bias is not None:
                torch.testing.assert_close(merged.gate_up_bias[0], block.gate_up_bias[anchor], rtol=1e-6, atol=1e-6)
            assert report["error_before"] < 1e-5
            if report["refit"]:  # the ridge shrinks the exact solution a little, nothing more
                assert report["error_after"] < 2e-3
                continue
            torch.testing.assert_close(merged.down[0], block.down[anchor], rtol=1e-5, atol=1e-5)
            if block.down_bias is not None:
                torch.testing.assert_close(merged.down_bias[0], block.down_bias[anchor], rtol=1e-5, atol=1e-5)


def _group_output(adapter, moe, x, ids, weights, mask):
    """Per token, the sum over its top-k slots that ``mask`` marks of the rule's output weight times the expert's
    output on its input (float64)."""
    rule = adapter.routing_rule()
    out = torch.zeros_like(x, dtype=torch.float64)
    for slot in range(ids.shape[1]):
        for expert in ids[mask[:, slot], slot].unique().tolist():
            rows = (ids[:, slot] == expert) & mask[:, slot]
            weight = weights[rows, slot, None]
            expert_out = adapter.expert_output(moe, expert, rule.expert_input(x[rows], weight))
            out[rows] += (rule.output_weight(weight) * expert_out).double()
    return out


def _group_error(adapter, moe, merged, members, position, hidden):
    """The group's relative output error with expert ``position`` of ``merged`` in its place (its input: the mean of
    the inputs its members saw; its output weight: the sum of theirs), computed directly."""
    rule = adapter.routing_rule()
    ids, weights = adapter.route(moe, adapter.router_logits(moe, hidden))
    in_group = torch.isin(ids, torch.tensor(members))
    rows = in_group.any(1)
    x, mask, ids, weights = hidden[rows], in_group[rows], ids[rows], weights[rows]
    original = _group_output(adapter, moe, x, ids, weights, mask)
    inputs = sum(rule.expert_input(x, weights[:, s : s + 1]) * mask[:, s : s + 1] for s in range(ids.shape[1]))
    merged_input = inputs / mask.sum(1, keepdim=True)
    total_weight = (rule.output_weight(weights) * mask).sum(1, keepdim=True)
    replaced = (total_weight * adapter.expert_output(merged, position, merged_input)).double()
    return float(((replaced - original) ** 2).sum() / (original**2).sum()) ** 0.5


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "llama4", "nemotron_h"])
def test_refit_reduces_the_groups_output_error(family, tiny_checkpoints):
    adapter, moe = _layer_view(tiny_checkpoints[family])
    hidden = _tokens(moe, 400, seed=5)
    groups = _groups(moe.num_experts)
    averaged, before = merge_experts(adapter, moe, groups, hidden, refit=False)
    refitted, after = merge_experts(adapter, moe, groups, hidden, refit=True)
    for position, members in enumerate(groups):
        if len(members) == 1:
            continue
        assert after[position]["refit"] and after[position]["refit_skipped"] is None
        measured_before = _group_error(adapter, moe, averaged, members, position, hidden)
        measured_after = _group_error(adapter, moe, refitted, members, position, hidden)
        assert before[position]["error_after"] == pytest.approx(measured_before, rel=1e-3)
        assert after[position]["error_before"] == pytest.approx(measured_before, rel=1e-3)
        assert after[position]["error_after"] == pytest.approx(measured_after, rel=1e-3)
        assert measured_after < 0.95 * measured_before


def test_group_never_routed_is_a_uniform_mean_anchored_on_its_first_member(tiny_checkpoints):
    adapter, moe = _layer_view(tiny_checkpoints["gpt_oss"])
    bias = moe.router_bias.clone()
    bias[[1, 2]] = -1e4
    block = dataclasses.replace(moe, router_bias=bias)
    hidden = _tokens(moe, 300)
    merged, reports = merge_experts(adapter, block, [[0, 3], [1, 2]], hidden)
    report = reports[1]
    assert report["tokens"] == 0 and report["weights"] == [0.5, 0.5] and report["anchor"] == block.expert_ids[1]
    assert report["aligned_on"] == "weights" and report["refit_skipped"] == "no routed tokens"
    assert report["error_before"] is None and merged.expert_ids[1] == block.expert_ids[1]
    tensors, routers, anchor = _reference(adapter, block, [1, 2], hidden, refit=False)
    assert anchor == 1
    for name, expected in {**tensors, **routers}.items():
        torch.testing.assert_close(getattr(merged, name)[1], expected, rtol=1e-5, atol=1e-6)


def test_refit_is_skipped_with_fewer_tokens_than_neurons(tiny_checkpoints):
    adapter, moe = _layer_view(tiny_checkpoints["qwen3_moe"])
    _, reports = merge_experts(adapter, moe, [[0, 1, 2, 3, 4, 5, 6, 7]], _tokens(moe, 10))
    report = reports[0]
    assert report["tokens"] == 10 and not report["refit"] and "fewer than its 32 neurons" in report["refit_skipped"]
    assert report["aligned_on"] == "weights" and report["error_after"] == report["error_before"]


def test_signatures_are_normalised_outputs_on_evenly_spaced_tokens(tiny_checkpoints):
    adapter, moe = _layer_view(tiny_checkpoints["qwen3_moe"])
    hidden = _tokens(moe, 300)
    signatures = expert_signatures(adapter, _with_copy(moe, 2, 5), hidden, tokens=64)
    assert signatures.shape == (moe.num_experts, 64 * hidden.shape[1])
    picks = torch.arange(64) * 300 // 64
    expected = F.normalize(adapter.expert_output(moe, 3, hidden[picks]).reshape(-1), dim=0)
    torch.testing.assert_close(signatures[3], expected)
    torch.testing.assert_close(signatures.norm(dim=1), torch.ones(moe.num_experts))
    torch.testing.assert_close(signatures[5], signatures[2])
    tree = merge_tree(signatures)
    assert tree[0] == (2, 5), "identical experts merge first"
    assert torch.equal(
        expert_signatures(adapter, moe, hidden[:50], tokens=64), expert_signatures(adapter, moe, hidden[:50])
    )


def _brute_average_linkage(signatures):
    """Average linkage by its definition: the pair of clusters with the least mean pairwise cosine distance."""
    dist = 1 - signatures.double() @ signatures.double().T
    clusters = {e: [e] for e in range(signatures.shape[0])}
    merges = []
    while len(clusters) > 1:
        labels = sorted(clusters)
        pairs = [(a, b) for i, a in enumerate(labels) for b in labels[i + 1 :]]
        mean = {(a, b): dist[clusters[a]][:, clusters[b]].mean().item() for a, b in pairs}
        a, b = min(pairs, key=lambda pair: mean[pair])
        merges.append((a, b))
        clusters[signatures.shape[0] + len(merges) - 1] = clusters.pop(a) + clusters.pop(b)
    return merges


def test_merge_tree_is_average_linkage_and_cuts_to_keep():
    signatures = F.normalize(torch.randn(12, 40, generator=torch.Generator().manual_seed(7)), dim=1)
    merges = merge_tree(signatures)
    assert merges == _brute_average_linkage(signatures)
    assert merges == merge_tree(signatures.clone())
    for keep in range(1, 13):
        groups = cut_tree(merges, 12, keep)
        assert len(groups) == keep and sorted(e for g in groups for e in g) == list(range(12))
        assert all(g == sorted(g) for g in groups) and [g[0] for g in groups] == sorted(g[0] for g in groups)
        assert groups == cut_tree(merges, 12, keep)
    assert cut_tree(merges, 12, 12) == [[e] for e in range(12)]


def test_router_groups_keep_equal_counts():
    signatures = F.normalize(torch.randn(16, 40, generator=torch.Generator().manual_seed(8)), dim=1)
    merges = merge_tree(signatures, group_size=4)
    assert len(merges) == 12
    for g in range(4):  # group g's merges, in local labels, are that group's own average linkage

        def local(label, g=g):
            return label - 4 * g if label < 16 else 4 + label - 16 - 3 * g

        got = [(local(a), local(b)) for a, b in merges[3 * g : 3 * g + 3]]
        assert got == _brute_average_linkage(signatures[4 * g : 4 * g + 4])
    for keep in (4, 8, 12, 16):
        groups = cut_tree(merges, 16, keep, group_size=4)
        assert len(groups) == keep and sorted(e for g in groups for e in g) == list(range(16))
        assert all(len({e // 4 for e in g}) == 1 for g in groups)
        assert [sum(1 for g in groups if g[0] // 4 == r) for r in range(4)] == [keep // 4] * 4
        assert groups == cut_tree(merge_tree(signatures, group_size=4), 16, keep, group_size=4)
    with pytest.raises(UserInputError):
        cut_tree(merges, 16, 6, group_size=4)
    with pytest.raises(UserInputError):
        cut_tree(merges, 16, 0)
    with pytest.raises(ValueError):
        cut_tree(merge_tree(signatures), 16, 8, group_size=4)


def test_deepseek_groups_end_to_end(tiny_checkpoints):
    adapter, moe = _layer_view(tiny_checkpoints["deepseek_v3"])
    hidden = _tokens(moe, 300)
    size = moe.num_experts // adapter.routing_rule().n_group
    merges = merge_tree(expert_signatures(adapter, moe, hidden), group_size=size)
    groups = cut_tree(merges, moe.num_experts, moe.num_experts // 2, group_size=size)
    merged, reports = merge_experts(adapter, moe, groups, hidden)
    assert merged.num_experts == moe.num_experts // 2 and merged.correction_bias.shape == (merged.num_experts,)
    assert [sum(1 for g in groups if g[0] // size == r) for r in range(2)] == [size // 2, size // 2]
    assert sorted(r["anchor"] for r in reports) == sorted(merged.expert_ids)
    out = adapter.moe_forward(merged, hidden)
    assert torch.isfinite(out).all()


def test_refit_is_skipped_where_the_merged_expert_never_activates(tiny_checkpoints):
    adapter, moe = _layer_view(tiny_checkpoints["qwen3_moe"])
    gate_up = moe.gate_up.clone()
    gate_up[[0, 1]] = 0
    block = dataclasses.replace(moe, gate_up=gate_up)
    merged, reports = merge_experts(adapter, block, [[0, 1]], _tokens(moe, 400))
    assert reports[0]["tokens"] >= moe.intermediate_size and reports[0]["aligned_on"] == "activations"
    assert not reports[0]["refit"] and reports[0]["refit_skipped"] == "its intermediate activations are all zero"
    assert torch.equal(merged.gate_up[0], gate_up[0]) and torch.isfinite(merged.down).all()
