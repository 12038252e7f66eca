"""Inkling 2 Loop's looped segment in the layer sweep: the sweep's last hidden states equal the stock forward's
(every pass restarting from the segment's input, reading the previous pass's messages), a looped layer's capture holds
the MoE inputs of all its passes, a replacement is used for every pass, and the block-output Fisher through the loop
equals the stock model's own gradients."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import checkpoint_adapter, copy_with_tokenizer, load_stock, text_sweep, token_batches
from synthetic import save_tiny_model

from moecompress.quantization.sensitivity import block_output_fisher, next_token_loss
from moecompress.runner.pipeline import _replacement
from moecompress.sweep.engine import CalibrationSweep

FAMILIES = ("inkling2_loop_text", "inkling2_loop")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    return save_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "source")


def _stock_calls(checkpoint, batches, module: str = "") -> dict[int, list[torch.Tensor]]:
    """Per decoder layer, what its ``module`` (the layer itself: its output; else that submodule's input) gave or
    took in each call of the stock forward, batch by batch."""
    model = load_stock(checkpoint)
    layers = model.get_submodule(checkpoint_adapter(checkpoint).runtime_layers_path)
    calls: dict[int, list[torch.Tensor]] = {}
    handles = []
    for index, layer in enumerate(layers):
        if module:
            hook = layer.get_submodule(module).register_forward_hook(
                lambda mod, args, out, index=index: calls.setdefault(index, []).append(args[0])
            )
        else:
            hook = layer.register_forward_hook(
                lambda mod, args, out, index=index: calls.setdefault(index, []).append(
                    out[0] if isinstance(out, tuple) else out
                )
            )
        handles.append(hook)
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    for handle in handles:
        handle.remove()
    return calls


def test_the_sweeps_last_hidden_states_are_the_stock_forwards(checkpoint):
    batches = token_batches()
    last = max(_stock_calls(checkpoint, batches))
    stock = _stock_calls(checkpoint, batches)[last]
    for swept, want in zip(text_sweep(checkpoint, batches).last_hidden, stock, strict=True):
        torch.testing.assert_close(swept, want, rtol=0, atol=5e-5)


def test_without_the_messages_the_passes_differ(checkpoint, monkeypatch):
    """The check above can fail: the same sweep with every pass's messages left out is far from the stock forward."""
    batches = token_batches()
    stock = _stock_calls(checkpoint, batches)
    forward = CalibrationSweep.forward_layer

    def without_messages(self, module, layer, hidden):
        if self._loop_messages is not None:
            self._loop_messages = [None] * len(hidden)
        return forward(self, module, layer, hidden)

    monkeypatch.setattr(CalibrationSweep, "forward_layer", without_messages)
    swept = text_sweep(checkpoint, batches).last_hidden
    assert (swept[0] - stock[max(stock)][0]).abs().max() > 0.1


def test_a_looped_layers_capture_holds_the_moe_inputs_of_every_pass(checkpoint):
    batches = token_batches()
    adapter = checkpoint_adapter(checkpoint)
    stock = _stock_calls(checkpoint, batches, adapter.moe_site_module)
    captures = {}

    def keep(capture):
        captures[capture.layer] = (capture.moe_input.clone(), capture.tags.clone())

    text_sweep(checkpoint, batches, consume=keep)
    passes, tokens = adapter.loop_passes, sum(batch["input_ids"].numel() for batch in batches)
    assert passes == 3 and list(adapter.loop_layers) == [2, 3, 4, 5]
    for layer, (inputs, tags) in captures.items():
        looped = layer in adapter.loop_layers
        calls = stock[layer]
        assert len(calls) == len(batches) * (passes if looped else 1)
        want = torch.cat([state.reshape(-1, state.shape[-1]) for state in calls])
        assert inputs.shape[0] == tags.shape[0] == tokens * (passes if looped else 1)
        torch.testing.assert_close(inputs, want.float(), rtol=0, atol=5e-5)


def test_a_replacement_is_used_for_every_pass(checkpoint):
    """Layer 3's experts replaced by zero experts in the sweep give the stock forward with those experts zeroed."""
    batches = token_batches()
    adapter = checkpoint_adapter(checkpoint)

    def zero_layer_3(capture):
        if capture.layer == 3:
            zeroed = capture.moe.select(list(range(capture.moe.num_experts)))
            zeroed.down = torch.zeros_like(zeroed.down)
            capture.replacement, capture.allowed = _replacement(capture.moe, zeroed)

    swept = text_sweep(checkpoint, batches, consume=zero_layer_3).last_hidden
    model = load_stock(checkpoint)
    experts = adapter.experts_of(model, 3)
    with torch.no_grad():
        adapter.stock_experts_weights(experts)[1].zero_()
        outputs = []
        handle = model.get_submodule(adapter.runtime_layers_path)[-1].register_forward_hook(
            lambda mod, args, out: outputs.append(out[0] if isinstance(out, tuple) else out)
        )
        for batch in batches:
            model(**batch)
        handle.remove()
    for got, expected in zip(swept, outputs, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=5e-5)
    unchanged = text_sweep(checkpoint, batches).last_hidden
    assert (unchanged[0] - outputs[0]).abs().max() > 1e-3


def test_the_block_output_fisher_through_the_loop_is_the_stock_models_gradient(checkpoint):
    batches = token_batches()
    adapter = checkpoint_adapter(checkpoint)
    fisher = block_output_fisher(checkpoint, batches, progress=False)
    model = load_stock(checkpoint)
    layers = model.get_submodule(adapter.runtime_layers_path)
    model.requires_grad_(False)
    outputs: dict[int, list[torch.Tensor]] = {}
    handles = []
    for index, layer in enumerate(layers):
        site = layer.get_submodule(adapter.moe_site_module)

        def keep(mod, args, out, index=index):
            out.retain_grad()
            outputs.setdefault(index, []).append(out)

        handles.append(site.register_forward_hook(keep))
    per_batch = []
    for batch in batches:
        outputs.clear()
        embeddings = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeddings).logits
        next_token_loss(logits, batch["input_ids"]).backward()
        per_batch.append(
            {index: [o.grad.float().pow(2).mean(dim=-1).reshape(-1) for o in outs] for index, outs in outputs.items()}
        )
    for handle in handles:
        handle.remove()
    for index in adapter.moe_layers():
        calls = len(per_batch[0][index])
        want = torch.cat([per_batch[b][index][p] for b in range(len(batches)) for p in range(calls)])
        assert fisher[index].shape == want.shape, index
        torch.testing.assert_close(fisher[index], want, rtol=1e-3, atol=1e-12)


def test_a_layer_scope_prune_loads_in_stock_transformers_and_routes_as_the_masked_input(checkpoint, tmp_path):
    """The pruned output loads with nothing missing, unexpected or mismatched, chooses at every looped layer and pass
    the experts the input chooses with the removed ones masked, and its logits are the masked input's up to the
    float32 noise that the loop's 15 layer calls amplify (the same check on Inkling 2's 4 layers differs by 2.4e-6;
    unmasked, the input differs by far more)."""
    import sys

    import transformers
    from click.testing import CliRunner

    from moecompress.cli.main import app

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "scripts"))
    from family_sweep import _mask_experts

    source = copy_with_tokenizer(checkpoint, tmp_path / "source")
    out = tmp_path / "pruned"
    options = ["--keep", "4", "--scope", "layer", "--calib-tokens", "512", "--seq-len", "32", "--no-eval"]
    result = CliRunner().invoke(app, ["prune", str(source), "--out", str(out), *options])
    assert result.exit_code == 0, result.output
    adapter, pruned = checkpoint_adapter(source), checkpoint_adapter(out)
    _, loading = getattr(transformers, pruned.auto_class).from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    report = json.loads((out / "moecompress_report.json").read_text())
    removed = {int(layer): entry["removed"] for layer, entry in report["layers"].items()}
    reference, model, unmasked = load_stock(source), load_stock(out), load_stock(source)
    _mask_experts(reference, adapter, source, removed, {})
    routes = {name: {} for name in ("reference", "pruned")}
    for name, stock, ids in (("reference", reference, None), ("pruned", model, pruned)):
        for layer in adapter.moe_layers():
            id_map = torch.tensor((ids or adapter).route_ids(layer))

            def record(mod, args, output, name=name, layer=layer, id_map=id_map):
                routes[name].setdefault(layer, []).append(id_map[adapter.route_of(output)[2]].sort(dim=-1)[0])

            adapter.router_of(stock, layer).register_forward_hook(record)
    ids = torch.randint(3, 380, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, free = (stock(input_ids=ids).logits for stock in (reference, model, unmasked))
    for layer in adapter.moe_layers():
        calls = routes["pruned"][layer]
        assert len(calls) == (adapter.loop_passes if layer in adapter.loop_layers else 1)
        assert all(torch.equal(a, b) for a, b in zip(calls, routes["reference"][layer], strict=True)), layer
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert (got - free).abs().max() > 1e-2


def test_qat_captures_and_replays_the_routes_of_every_pass(checkpoint):
    from moecompress.training.replay import RouteCapture, RouteReplay

    adapter = checkpoint_adapter(checkpoint)
    teacher, student = load_stock(checkpoint), load_stock(checkpoint)
    capture, replay = RouteCapture(teacher, adapter), RouteReplay(student, adapter, "recorded")
    ids = torch.randint(3, 380, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = teacher(input_ids=ids).logits
        for layer in adapter.moe_layers():
            passes = adapter.loop_passes if layer in adapter.loop_layers else 1
            assert capture.routes[layer][0].shape[0] == passes * ids.numel()
        replay.routes, replay.active = capture.routes, set(adapter.moe_layers())
        torch.testing.assert_close(student(input_ids=ids).logits, want, rtol=0, atol=1e-6)
        assert all(torch.equal(replay.own_ids[layer], capture.routes[layer][0]) for layer in adapter.moe_layers())
        tokens = ids.numel()
        replay.routes = {
            layer: tuple(route.roll(tokens, dims=0) for route in routes) if layer in adapter.loop_layers else routes
            for layer, routes in capture.routes.items()
        }
        assert (student(input_ids=ids).logits - want).abs().max() > 1e-3
    capture.remove()
    replay.remove()
