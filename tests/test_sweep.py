"""The layer-wise sweep reproduces what each MoE block sees inside the stock model's own forward."""

import pytest
import torch
import transformers
from helpers import load_stock, stock_inputs
from synthetic import FAMILIES

from moecompress.checkpoint import CheckpointReader
from moecompress.families import adapter_for
from moecompress.sweep.engine import CalibrationSweep


def _stock_moe_inputs(model, adapter, batches, module_name=None) -> dict:
    """What every MoE block (or ``module_name`` of each MoE layer) receives inside the stock model's own forward, per
    layer, all batches."""
    expected: dict = {}
    handles = [
        adapter.decoder_layers(model)[layer]
        .get_submodule(adapter.runtime_in_layer(layer, module_name or adapter.moe_site_module))
        .register_forward_hook(
            lambda mod, args, out, layer=layer: expected.setdefault(layer, []).append(
                args[0].reshape(-1, args[0].shape[-1])
            )
        )
        for layer in adapter.moe_layers()
    ]
    with torch.no_grad():
        for batch in batches:
            model(**batch, use_cache=False)
    for handle in handles:
        handle.remove()
    return expected


@pytest.mark.parametrize("capture_attention", [True, False], ids=["eager", "default-attention"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sweep_matches_stock_forward(family, capture_attention, tiny_checkpoints):
    source = tiny_checkpoints[family]
    config = CheckpointReader(source).config
    adapter = adapter_for(config)
    model = load_stock(source)
    if capture_attention:  # the sweep attends eagerly to return the weights; so does the reference
        model.set_attn_implementation("eager")
    generator = torch.Generator().manual_seed(0)
    batches = [stock_inputs(model, torch.randint(0, 300, (2, 24), generator=generator)) for _ in range(2)]

    expected = _stock_moe_inputs(model, adapter, batches)
    routed = (
        _stock_moe_inputs(model, adapter, batches, adapter.router_input_module) if adapter.router_input_module else {}
    )

    tags = torch.zeros(2 * 2 * 24, dtype=torch.long)
    sweep = CalibrationSweep(source, batches, tags, ["text"], capture_attention=capture_attention, progress=False)
    # float32 rounding: Qwen3-Next's linear attention measured 4.7e-5 apart from the stock forward, Inkling 2 Loop's
    # looped layers (15 layer calls) 2.2e-5
    atol = 1e-4
    layers = []
    for capture in sweep.run():
        layers.append(capture.layer)
        torch.testing.assert_close(capture.moe_input, torch.cat(expected[capture.layer]), rtol=1e-4, atol=atol)
        if routed:
            torch.testing.assert_close(capture.router_input, torch.cat(routed[capture.layer]), rtol=1e-4, atol=atol)
        else:
            assert capture.router_input is None
        if capture_attention and not adapter.softmax_attention(capture.layer):
            assert capture.attention_received is None, "a linear-attention layer has no attention weights"
        elif capture_attention:
            assert capture.attention_received.shape == (96,)
            assert torch.all(capture.attention_received > 0)
        else:
            assert capture.attention_received is None
        assert capture.moe.num_experts == adapter.num_experts
    assert layers == adapter.moe_layers()


def test_sweep_with_images_matches_stock_forward(tiny_checkpoints):
    """Vision tokens, M-RoPE positions and deepstack features injected between layers are all reproduced."""
    from synthetic import tiny_tokenizer

    from moecompress.calibration.vision import builtin_image_captions, image_processor_for, vision_batches

    source = tiny_checkpoints["qwen3_vl_moe"]
    config = CheckpointReader(source).config
    adapter = adapter_for(config)
    model = getattr(transformers, adapter.auto_class).from_pretrained(source, dtype=torch.float32).eval()
    items = builtin_image_captions("shapes", count=3, size=32)
    batches, tags, names = vision_batches(
        items, tiny_tokenizer(), image_processor_for(source, config["vision_config"]), **adapter.vision_token_ids()
    )
    assert names == ["text", "vision"] and (tags == 1).sum() == 3 * 16

    expected = _stock_moe_inputs(model, adapter, batches)
    sweep = CalibrationSweep(source, batches, tags, names, progress=False)
    plans_with_injections = sum(bool(plan.injections) for plan in sweep.plans)
    assert plans_with_injections == len(batches), "deepstack features should be injected after layer 0"
    for capture in sweep.run():
        torch.testing.assert_close(capture.moe_input, torch.cat(expected[capture.layer]), rtol=1e-4, atol=1e-4)


def test_a_capture_in_the_compute_dtype_shares_the_layer_experts_and_is_released_after(tmp_path):
    """``moe_in_compute_dtype``: the view's experts are the very float32 tensors the layer computes with (one
    copy, not two: the layer's experts module computes from the view), equal to the checkpoint's bf16 values; every
    capture's tensors are dropped when the next layer is asked for, and the experts module lets go of them."""
    from synthetic import write_synthetic_qwen3_moe

    source = tmp_path / "bf16"
    write_synthetic_qwen3_moe(source, 2, 64, 4, 32, heads=4, kv_heads=2, top_k=2)
    reader = CheckpointReader(source)
    adapter = adapter_for(reader.config)
    batches = [{"input_ids": torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))}]
    tags = torch.zeros(32, dtype=torch.long)
    sweep = CalibrationSweep(source, batches, tags, ["text"], moe_in_compute_dtype=True, progress=False)
    seen = []
    original_materialise = sweep.materialise

    def materialise(layer):
        module, moe = original_materialise(layer)
        seen.append(module)
        return module, moe

    sweep.materialise = materialise
    captures = []
    for capture in sweep.run():
        experts = seen[-1].get_submodule(adapter.moe_block_name).experts
        stored = adapter.split_layer(capture.layer, reader.read(sweep.layer_keys[capture.layer]))[0]
        stored_dtype = stored.gate_up.dtype
        assert stored_dtype == torch.bfloat16 and capture.moe.gate_up.dtype == torch.float32
        assert experts.source.view.gate_up.data_ptr() == capture.moe.gate_up.data_ptr()
        assert torch.equal(capture.moe.gate_up, stored.gate_up.float())
        captures.append(capture)
    assert len(captures) == len(adapter.moe_layers())
    assert all(c.moe is None and c.moe_input is None for c in captures)
    assert all(module.get_submodule(adapter.moe_block_name).experts.source is None for module in seen)


@pytest.mark.parametrize("bf16", [False, True])
def test_the_text_head_holds_no_input_embeddings_and_computes_the_stock_logits(
    tiny_checkpoints, bf16, tmp_path, monkeypatch
):
    """The head for text batches leaves the input embeddings as a zero-size placeholder, keeps an untied 16-bit
    head in its dtype (``UpcastingHead``), and gives the stock model's logits for the same last hidden states (in
    both the 16-bit family checkpoint and a float32 copy)."""
    from moecompress.sweep import engine as sweep_module

    source = tiny_checkpoints["qwen3_moe"]
    if bf16:
        load_stock(source).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
        source = tmp_path / "bf16"
    model = load_stock(source, dtype=torch.float32)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 24, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    sweep = CalibrationSweep(source, [{"input_ids": ids}], torch.zeros(48, dtype=torch.long), ["text"], progress=False)
    seen = {}
    move = sweep_module._move

    def spy(skeleton, device):
        move(skeleton, device)
        seen["embeddings"], seen["head"] = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()

    monkeypatch.setattr(sweep_module, "_move", spy)
    logits = next(sweep.text_head_logits([{"input_ids": ids}], [hidden]))
    assert seen["embeddings"].weight.dim() == 2 and not any(seen["embeddings"].weight.stride())
    stored = CheckpointReader(source).tensor("lm_head.weight").dtype
    assert isinstance(seen["head"], sweep_module.UpcastingHead) == (stored.itemsize == 2)
    assert seen["head"].weight.dtype == stored
    with torch.no_grad():
        expected = model.lm_head(model.model.norm(hidden))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("replace_blocks", [True, False], ids=["replaced", "kept"])
def test_a_replacing_sweep_skips_the_original_experts_and_computes_the_same(
    replace_blocks, tiny_checkpoints, monkeypatch
):
    """``replaces``: the capturing forward leaves the routed experts out; with a replacement (here the block's own
    weights) the layer is computed through it, without one it is run again in full: the same inputs and outputs
    as a sweep that computes the original block first, with one expert computation per batch and layer fewer."""
    from moecompress.sweep.view_experts import ExpertSource

    source = tiny_checkpoints["qwen3_moe"]
    adapter = adapter_for(CheckpointReader(source).config)
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 300, (2, 24), generator=generator)} for _ in range(2)]
    tags = torch.zeros(2 * 2 * 24, dtype=torch.long)
    calls = []
    combine = type(adapter).combine_experts
    monkeypatch.setattr(type(adapter), "combine_experts", lambda self, *args: calls.append(1) or combine(self, *args))

    def run(replaces: bool) -> tuple[list, list, int]:
        calls.clear()
        sweep = CalibrationSweep(source, batches, tags, ["text"], replaces=replaces, progress=False)
        inputs = []
        for capture in sweep.run():
            inputs.append(capture.moe_input)
            if replace_blocks:
                capture.replacement = ExpertSource(capture.moe)
        return inputs, sweep.last_hidden, len(calls)

    inputs, outputs, computed = run(replaces=True)
    expected_inputs, expected_outputs, expected_computed = run(replaces=False)
    assert all(torch.equal(a, b) for a, b in zip(inputs, expected_inputs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected_outputs, strict=True))
    moe_layers = len(adapter.moe_layers())
    assert computed == expected_computed - (len(batches) * moe_layers if replace_blocks else 0)


def test_a_replacing_sweep_computes_each_attention_once_and_can_leave_the_last_layer(tiny_checkpoints, monkeypatch):
    """With a replacement the recomputing forward takes the attention outputs of the capturing one (the same
    outputs as computing it again); ``last_outputs_unused`` leaves the last layer's replacement uncomputed."""
    from moecompress.sweep.view_experts import ExpertSource

    source = tiny_checkpoints["qwen3_moe"]
    adapter = adapter_for(CheckpointReader(source).config)
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 300, (2, 24), generator=generator)} for _ in range(2)]
    tags = torch.zeros(2 * 2 * 24, dtype=torch.long)
    attention = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention
    calls = {"attention": 0, "experts": 0}
    forward, combine = attention.forward, type(adapter).combine_experts

    def counted(self, *args, **kwargs):
        calls["attention"] += 1
        return forward(self, *args, **kwargs)

    def combined(self, *args):
        calls["experts"] += 1
        return combine(self, *args)

    monkeypatch.setattr(attention, "forward", counted)
    monkeypatch.setattr(type(adapter), "combine_experts", combined)

    def run(replaces: bool, last_unused: bool = False) -> tuple[list, list | None]:
        calls.update(attention=0, experts=0)
        sweep = CalibrationSweep(
            source, batches, tags, ["text"], replaces=replaces, last_outputs_unused=last_unused, progress=False
        )
        inputs = []
        for capture in sweep.run():
            inputs.append(capture.moe_input)
            capture.replacement = ExpertSource(capture.moe)
        return inputs, sweep.last_hidden

    layers = adapter.num_layers
    inputs, outputs = run(replaces=True)
    assert calls == {"attention": len(batches) * layers, "experts": len(batches) * layers}
    expected_inputs, expected_outputs = run(replaces=False)
    assert calls["attention"] == 2 * len(batches) * layers
    assert all(torch.equal(a, b) for a, b in zip(inputs, expected_inputs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected_outputs, strict=True))
    inputs, outputs = run(replaces=True, last_unused=True)
    assert outputs is None and calls["experts"] == len(batches) * (layers - 1)
    assert all(torch.equal(a, b) for a, b in zip(inputs, expected_inputs, strict=True))
