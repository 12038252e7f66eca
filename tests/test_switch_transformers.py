"""Switch Transformers' expert view (encoder and decoder stacks numbered as one, per-sequence expert capacity) and
the layer sweep over both stacks against the stock modules; the family itself stays refused until the passes,
calibration, evaluation and plugin handle encoder-decoder models."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

from moecompress.errors import UserInputError
from moecompress.families import adapter_for
from moecompress.families.switch_transformers import SwitchTransformersAdapter, capacity_kept

E, H, CAPACITY = 4, 32, 5
CONFIG = dict(
    vocab_size=96,
    d_model=H,
    d_kv=8,
    d_ff=48,
    num_heads=4,
    num_layers=4,
    num_decoder_layers=2,
    num_sparse_encoder_layers=2,
    num_sparse_decoder_layers=2,
    num_experts=E,
    expert_capacity=CAPACITY,
    router_jitter_noise=0.0,
    dropout_rate=0.0,
    decoder_start_token_id=0,
)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    built = SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(**CONFIG)).eval()
    with torch.no_grad():  # routers initialised near zero send every token to one expert; spread them out
        for name, param in built.named_parameters():
            if "router.classifier" in name:
                param.normal_(0, 1.0)
            elif "layer_norm" in name:  # not all ones, so that a norm missed or swapped shows
                param.normal_(1.0, 0.3)
    return built


@pytest.fixture(scope="module")
def adapter(model):
    return SwitchTransformersAdapter(model.config.to_dict())


def _view(adapter, model, layer):
    prefix = adapter.layer_prefix(layer)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith(prefix)}
    return (*adapter.split_layer(layer, tensors), tensors)


def test_the_family_is_registered_and_a_dense_config_refused_in_one_line():
    assert isinstance(adapter_for(SwitchTransformersConfig(**CONFIG).to_dict()), SwitchTransformersAdapter)
    dense = SwitchTransformersConfig(**{**CONFIG, "num_sparse_encoder_layers": 0, "num_sparse_decoder_layers": 0})
    with pytest.raises(UserInputError, match="switch_transformers model has no MoE layers"):
        adapter_for(dense.to_dict())


def test_layers_span_both_stacks_and_the_sparse_blocks_are_transformers_own(adapter, model):
    assert adapter.num_layers == 6 and adapter.moe_layers() == [1, 3, 4, 5]
    stock = [block.is_sparse for block in adapter.decoder_layers(model)]
    assert [adapter.is_moe_layer(layer) for layer in range(6)] == stock
    assert adapter.layer_prefix(5) == "decoder.block.1." and adapter.layer_of_key("decoder.block.1.layer.0.x") == 5
    assert adapter.layer_of_key("encoder.final_layer_norm.weight") is None
    assert adapter.classify_key("decoder.block.1.layer.2.mlp.experts.expert_3.wo.weight") == "experts"
    assert adapter.classify_key("encoder.block.1.layer.1.mlp.router.classifier.weight") == "router"
    assert adapter.classify_key("decoder.block.1.layer.1.EncDecAttention.k.weight") == "attention"


@pytest.mark.parametrize("layer", [1, 5])
def test_split_and_join_are_inverse_and_the_view_is_the_stock_experts(adapter, model, layer):
    moe, rest, layout, tensors = _view(adapter, model, layer)
    ff = "layer.2" if layer >= 4 else "layer.1"
    stack = "decoder.block.1" if layer >= 4 else "encoder.block.1"
    assert torch.equal(moe.gate_up[2], tensors[f"{stack}.{ff}.mlp.experts.expert_2.wi.weight"])
    assert torch.equal(moe.down[3], tensors[f"{stack}.{ff}.mlp.experts.expert_3.wo.weight"])
    assert not any(".mlp." in key for key in rest)
    joined = adapter.join_layer(layer, moe, rest, layout)
    assert joined.keys() == tensors.keys() and all(torch.equal(joined[k], tensors[k]) for k in tensors)


def test_capacity_keeps_the_first_tokens_of_each_expert_in_order():
    ids = torch.tensor([[0], [1], [0], [0], [1], [0]])
    assert capacity_kept(ids, 2, 2)[:, 0].tolist() == [True, True, True, False, True, False]


@pytest.mark.parametrize("layer", [1, 5])
def test_the_view_computes_the_stock_block_capacity_included(adapter, model, layer):
    moe, *_ = _view(adapter, model, layer)
    hidden = torch.randn(2, 24, H, generator=torch.Generator().manual_seed(layer))
    mlp = adapter.moe_block_of(model, layer)
    with torch.no_grad():
        stock = mlp(hidden)
        dispatch = mlp.router(hidden)[0]
        view = torch.stack([adapter.moe_forward(moe, sequence) for sequence in hidden])
    assert (dispatch.sum(dim=-1) == 0).any(), "the test's tokens must overflow an expert's capacity"
    torch.testing.assert_close(view, stock, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layer", [1, 5])
def test_rerouting_around_removed_experts_is_the_view_with_those_experts_disallowed(adapter, model, layer):
    moe, *_ = _view(adapter, model, layer)
    allowed = torch.ones(E, dtype=torch.bool)
    allowed[[0, 2]] = False
    hidden = torch.randn(2, 24, H, generator=torch.Generator().manual_seed(10 + layer))
    mlp = adapter.moe_block_of(model, layer)
    block = adapter.decoder_layers(model)[layer]
    handles = adapter.reroute_hooks(block, lambda logits: adapter.route(moe, logits, allowed))
    try:
        with torch.no_grad():
            rerouted = mlp(hidden)
            dispatch = mlp.router(hidden)[0]
    finally:
        for handle in handles:
            handle.remove()
    assert dispatch[..., ~allowed].sum() == 0
    kept = moe.select([1, 3])
    with torch.no_grad():
        pruned = torch.stack([adapter.moe_forward(kept, sequence) for sequence in hidden])
        masked = torch.stack([adapter.moe_forward(moe, sequence, allowed) for sequence in hidden])
    torch.testing.assert_close(rerouted, masked, rtol=0, atol=1e-6)
    torch.testing.assert_close(pruned, masked, rtol=0, atol=1e-5)  # float32 rounding of the experts' matmuls


def test_a_pruned_checkpoint_loads_in_stock_transformers_with_the_masked_models_logits(adapter, model, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForSeq2SeqLM

    model.save_pretrained(tmp_path / "source")
    tensors = load_file(tmp_path / "source" / "model.safetensors")
    removed = {1: [0, 2], 3: [3, 1], 4: [1, 2], 5: [0, 3]}
    kept = {layer: [e for e in range(E) if e not in ids] for layer, ids in removed.items()}
    views, pruned = {}, {k: v for k, v in tensors.items() if adapter.layer_of_key(k) not in removed}
    for layer in removed:
        moe, rest, layout = adapter.split_layer(
            layer, {k: v for k, v in tensors.items() if adapter.layer_of_key(k) == layer}
        )
        views[layer] = moe
        pruned.update(adapter.join_layer(layer, moe.select(kept[layer]), rest, layout))
    out = tmp_path / "pruned"
    out.mkdir()
    save_file(pruned, out / "model.safetensors", metadata={"format": "pt"})
    config = adapter.with_expert_counts({layer: E - 2 for layer in removed}, kept)
    (out / "config.json").write_text(json.dumps(config))
    loaded, loading = AutoModelForSeq2SeqLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    assert SwitchTransformersAdapter(config).original_expert_ids(5) == [1, 2]

    handles = []
    layers = adapter.decoder_layers(model)
    for layer, ids in removed.items():
        allowed = torch.ones(E, dtype=torch.bool)
        allowed[ids] = False
        handles += adapter.reroute_hooks(
            layers[layer], lambda logits, moe=views[layer], allowed=allowed: adapter.route(moe, logits, allowed)
        )
    generator = torch.Generator().manual_seed(3)
    inputs = dict(
        input_ids=torch.randint(2, 96, (2, 24), generator=generator),
        decoder_input_ids=torch.randint(2, 96, (2, 16), generator=generator),
    )
    try:
        with torch.no_grad():
            masked = model(**inputs).logits
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        plain, got = model(**inputs).logits, loaded.eval()(**inputs).logits
    assert (plain - masked).abs().max() > 1e-3
    torch.testing.assert_close(got, masked, rtol=0, atol=1e-5)  # softmax over 2 logits or 4 with 2 masked: rounding


def _sweep(adapter, model, tmp_path, monkeypatch, batches):
    """The layer sweep over ``batches``, every source token tagged 0 and every decoder token 1."""
    import moecompress.sweep.engine as sweep_module

    model.save_pretrained(tmp_path / "source")
    monkeypatch.setattr(sweep_module, "adapter_for", lambda config, source=None: SwitchTransformersAdapter(config))
    tokens = sum(batch["input_ids"].numel() for batch in batches)
    decoder_tokens = sum(batch["decoder_input_ids"].numel() for batch in batches)
    return sweep_module.CalibrationSweep(
        tmp_path / "source",
        batches,
        torch.zeros(tokens, dtype=torch.long),
        ["source", "target"],
        progress=False,
        decoder_tags=torch.ones(decoder_tokens, dtype=torch.long),
    )


def _batches():
    generator = torch.Generator().manual_seed(5)
    return [
        dict(
            input_ids=torch.randint(2, 96, (2, length), generator=generator),
            decoder_input_ids=torch.randint(2, 96, (2, length - 6), generator=generator),
        )
        for length in (24, 20)
    ]


def _stock(adapter, model, batches):
    """The stock forward's MoE-block inputs by layer, the decoder's last block outputs and the logits, per batch."""
    inputs: dict[int, list[torch.Tensor]] = {layer: [] for layer in adapter.moe_layers()}
    handles = [
        adapter.moe_block_of(model, layer).register_forward_hook(
            lambda mod, args, out, into=inputs[layer]: into.append(args[0].reshape(-1, H))
        )
        for layer in adapter.moe_layers()
    ]
    last = []
    handles.append(model.decoder.block[-1].register_forward_hook(lambda mod, args, out: last.append(out[0])))
    try:
        with torch.no_grad():
            logits = [model(**batch).logits for batch in batches]
    finally:
        for handle in handles:
            handle.remove()
    return inputs, last, logits


def test_the_layer_sweep_runs_the_encoder_then_the_decoder_on_its_output_as_the_stock_model(
    adapter, model, tmp_path, monkeypatch
):
    """Each MoE block's input, the decoder's last output and the logits equal the stock forward's exactly: the
    decoder starts from its own embedded tokens, reads the normalised encoder output, and each stack's later blocks
    get the position biases its first block computed."""
    batches = _batches()
    sweep = _sweep(adapter, model, tmp_path, monkeypatch, batches)
    inputs, last, logits = _stock(adapter, model, batches)
    seen = []
    for capture in sweep.run():
        seen.append(capture.layer)
        torch.testing.assert_close(capture.moe_input, torch.cat(inputs[capture.layer]), rtol=0, atol=0)
        sources = [batch["input_ids" if capture.layer < 4 else "decoder_input_ids"] for batch in batches]
        assert capture.sequence_lengths == [row.numel() for ids in sources for row in ids]
        assert torch.equal(capture.tags, torch.full((capture.moe_input.shape[0],), int(capture.layer >= 4)))
    assert seen == adapter.moe_layers()
    for got, want in zip(sweep.last_hidden, last, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(sweep.head_logits(batches, sweep.last_hidden), logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("stop", [4, 5])
def test_a_resumed_sweep_restores_the_encoder_output_and_the_position_biases(
    adapter, model, tmp_path, monkeypatch, stop
):
    from moecompress.sweep.state import SweepState

    batches = _batches()
    state = SweepState(tmp_path / "state")
    for capture in _sweep(adapter, model, tmp_path, monkeypatch, batches).run(state):
        if capture.layer == stop:
            break
    assert SweepState(tmp_path / "state").last_layer == stop - 1
    assert {name.split("/")[0] for name in state.carried()} == {"enc", "in"}
    resumed = _sweep(adapter, model, tmp_path, monkeypatch, batches)
    for _ in resumed.run(SweepState(tmp_path / "state")):
        pass
    _, last, _ = _stock(adapter, model, batches)
    for got, want in zip(resumed.last_hidden, last, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("layer", [1, 5])
def test_frequency_and_delta_h_apply_the_capacity_per_sequence(adapter, model, layer):
    """With the sequences' lengths the passes route whole sequences: frequency counts the tokens the stock router
    dispatches (not those past an expert's capacity) and single-pass ΔH equals the view's forward of each sequence
    without each expert in turn (chunks small enough to split the calibration set)."""
    from moecompress.passes.expert_scores import layer_expert_stats

    moe, *_ = _view(adapter, model, layer)
    hidden = torch.randn(3, 24, H, generator=torch.Generator().manual_seed(20 + layer))
    with torch.no_grad():
        dispatch = adapter.moe_block_of(model, layer).router(hidden)[0]
        stats = layer_expert_stats(adapter, moe, hidden.reshape(-1, H), chunk_tokens=50, sequence_lengths=[24] * 3)
        eye = torch.eye(E, dtype=torch.bool)
        brute = torch.stack(
            [
                torch.cat(
                    [
                        (adapter.moe_forward(moe, sequence) - adapter.moe_forward(moe, sequence, ~eye[e])).norm(dim=-1)
                        for sequence in hidden
                    ]
                )
                for e in range(E)
            ],
            dim=1,
        )
        flat = layer_expert_stats(adapter, moe, hidden.reshape(-1, H))
    assert (dispatch.sum(dim=-1) == 0).any(), "the test's tokens must overflow an expert's capacity"
    assert torch.equal(stats.routed_counts, dispatch.reshape(-1, E).sum(dim=0).float())
    torch.testing.assert_close(stats.delta_h, brute, rtol=0, atol=1e-5)
    assert not torch.equal(flat.routed_counts, stats.routed_counts)


@pytest.mark.parametrize("layer", [1, 5])
def test_gptq_calibrates_each_expert_on_the_tokens_the_stock_router_dispatches_to_it(adapter, model, layer):
    from moecompress.quantization.experts import routed_inputs, routed_tokens

    moe, *_ = _view(adapter, model, layer)
    hidden = torch.randn(3, 24, H, generator=torch.Generator().manual_seed(30 + layer))
    flat = hidden.reshape(-1, H)
    with torch.no_grad():
        dispatch = adapter.moe_block_of(model, layer).router(hidden)[0].reshape(-1, E)
    tokens = routed_tokens(adapter, moe, flat, sequence_lengths=[24] * 3)
    inputs = routed_inputs(adapter, moe, flat, sequence_lengths=[24] * 3)
    assert (dispatch.sum(dim=-1) == 0).any(), "the test's tokens must overflow an expert's capacity"
    for expert in range(E):
        assert torch.equal(tokens[expert], dispatch[:, expert].nonzero()[:, 0])
        assert torch.equal(inputs[expert], flat[dispatch[:, expert].bool()])
    assert sum(map(len, routed_tokens(adapter, moe, flat))) == flat.shape[0] > int(dispatch.sum())


def test_the_low_rank_compensation_measures_each_expert_on_the_tokens_the_stock_router_dispatches_to_it(adapter, model):
    from moecompress.quantization.compensation import layer_errors

    layer = 5
    moe, *_ = _view(adapter, model, layer)
    hidden = torch.randn(3, 24, H, generator=torch.Generator().manual_seed(40))
    flat = hidden.reshape(-1, H)
    with torch.no_grad():
        dispatch = adapter.moe_block_of(model, layer).router(hidden)[0].reshape(-1, E).bool()
    # d_ff 48 fits no group size; what is measured here is which tokens each expert is given, not the error
    quantized = SimpleNamespace(dequantized_expert=lambda expert: (moe.gate_up[expert] * 0.9, moe.down[expert] * 0.9))
    errors = layer_errors(
        adapter, moe, quantized, flat, keep=0, min_tokens=1, keep_inputs=True, sequence_lengths=[24] * 3
    )
    assert (dispatch.sum(dim=-1) == 0).any(), "the test's tokens must overflow an expert's capacity"
    for expert in range(E):
        up = [inputs for (e, which), inputs in errors.inputs.items() if e == expert and which != "down"]
        assert up and all(torch.equal(inputs, flat[dispatch[:, expert]]) for inputs in up)


def _seq2seq_source(tmp_path, monkeypatch):
    """A tiny checkpoint with a tokenizer that has T5's sentinels, the family's adapter patched in for the sweep
    (the family itself is refused)."""
    from synthetic import tiny_tokenizer

    import moecompress.evals.streamed as streamed_module
    import moecompress.sweep.engine as sweep_module

    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<extra_id_{i}>" for i in range(100)]})
    torch.manual_seed(1)
    model = SwitchTransformersForConditionalGeneration(
        SwitchTransformersConfig(**{**CONFIG, "vocab_size": len(tokenizer), "expert_capacity": 64})
    ).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "router.classifier" in name:
                param.normal_(0, 1.0)
    source = tmp_path / "source"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    patched = lambda config, source=None: SwitchTransformersAdapter(config)  # noqa: E731
    monkeypatch.setattr(sweep_module, "adapter_for", patched)
    monkeypatch.setattr(streamed_module, "adapter_for", patched)
    return model, tokenizer, source, SwitchTransformersAdapter(model.config.to_dict())


def test_calibration_batches_are_span_corrupted_and_the_sweep_tags_each_stack_with_its_tokens(tmp_path, monkeypatch):
    """The seq2seq calibration: T5's span corruption of the windows (sentinels ``<extra_id_i>`` from the tokenizer,
    the decoder starting at ``decoder_start_token_id``), the sweep taking the decoder's tags out of the batches,
    and the head's logits those of the stock forward on the same source and decoder input."""
    import moecompress.sweep.engine as sweep_module
    from moecompress.calibration.batches import sampled_windows, tokenize_documents
    from moecompress.calibration.model_inputs import calibration_batches
    from moecompress.calibration.sources import load_documents
    from moecompress.calibration.span_corruption import DECODER_TAGS, corrupt_spans, model_inputs, sentinel_ids

    model, tokenizer, source, adapter = _seq2seq_source(tmp_path, monkeypatch)
    sentinels = sentinel_ids(tokenizer)
    assert len(sentinels) == 100 and tokenizer.convert_ids_to_tokens(sentinels[7]) == "<extra_id_7>"

    batches, tags, names = calibration_batches(adapter, source, "builtin:prose", 96, 32, 2, 11, 0)
    stream = tokenize_documents(load_documents("builtin:prose", default_part="calib"), tokenizer)
    windows = sampled_windows(stream, 32, 96, 11)
    want = corrupt_spans(windows.input_ids, windows.tags, sentinels, tokenizer.eos_token_id, 0, 11)
    assert [b["input_ids"].shape[0] for b in batches] == [2, 1]
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), want.input_ids)
    assert torch.equal(torch.cat([b["decoder_input_ids"] for b in batches]), want.decoder_input_ids)
    assert torch.equal(torch.cat([b[DECODER_TAGS] for b in batches]), want.decoder_tags)
    assert torch.equal(tags, want.source_tags.reshape(-1)) and names == windows.tag_names
    assert want.decoder_input_ids[:, 0].eq(0).all() and torch.isin(want.input_ids, torch.tensor(sentinels)).any()

    sweep = sweep_module.CalibrationSweep(source, batches, tags, names, progress=False)
    assert torch.equal(sweep.decoder_tags, want.decoder_tags.reshape(-1))
    for capture in sweep.run():
        stack_tags = tags if capture.layer < 4 else want.decoder_tags.reshape(-1)
        assert torch.equal(capture.tags, stack_tags) and capture.moe_input.shape[0] == stack_tags.numel()
    with torch.no_grad():
        stock = [model(**model_inputs(batch)).logits for batch in batches]
    for got, expected in zip(sweep.head_logits(batches, sweep.last_hidden), stock, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_evaluation_is_the_perplexity_of_the_decoders_targets_whole_and_streamed_alike(tmp_path, monkeypatch):
    """The whole model's and the streamed evaluation's figures on the same span-corrupted windows are equal, and
    the perplexity is that of the stock model's loss on the labels; against itself the KL is 0 and the routing
    agreement 1."""
    from moecompress.calibration.batches import consecutive_windows, tokenize_documents
    from moecompress.calibration.sources import load_documents
    from moecompress.calibration.span_corruption import seq2seq_windows
    from moecompress.evals.perplexity import SEQ2SEQ_SEED, evaluate_windows
    from moecompress.evals.streamed import evaluate_streamed

    model, tokenizer, source, adapter = _seq2seq_source(tmp_path, monkeypatch)
    stream = tokenize_documents(load_documents("builtin:prose", default_part="heldout"), tokenizer)
    plain = consecutive_windows(stream, 32, 160)
    windows = seq2seq_windows(plain.input_ids, plain.tags, tokenizer, adapter.config, SEQ2SEQ_SEED)
    whole = evaluate_windows(model, adapter, windows, (model, adapter), progress=False)
    streamed = evaluate_streamed(source, windows, source, progress=False)
    assert whole.tokens == streamed.tokens == windows.labels.numel()
    for name in ("perplexity", "kl", "routing_agreement", "reference_perplexity"):
        assert getattr(streamed, name) == pytest.approx(getattr(whole, name), rel=1e-5, abs=1e-9), name
    assert whole.kl == 0.0 and whole.routing_agreement == 1.0
    with torch.no_grad():
        loss = model(input_ids=windows.input_ids, decoder_input_ids=windows.decoder_input_ids, labels=windows.labels)
    assert whole.perplexity == pytest.approx(float(loss.loss.exp()), rel=1e-5)


def test_the_fisher_pass_follows_the_gradient_through_the_decoder_into_the_encoder(adapter, model, tmp_path):
    """Each MoE block's ‖∂loss/∂output‖² / H from the layer-at-a-time backward equals the stock model's autograd
    under the decoder's next-token loss, the encoder's blocks included (their gradient reaches them through every
    decoder block's cross-attention and the encoder's final norm)."""
    from moecompress.quantization.sensitivity import block_output_fisher, next_token_loss

    batches = _batches()
    model.save_pretrained(tmp_path / "source")
    outputs = {}
    handles = [
        adapter.moe_block_of(model, layer).register_forward_hook(
            lambda module, args, out, layer=layer: outputs.setdefault(layer, out)
        )
        for layer in adapter.moe_layers()
    ]
    expected = {layer: [] for layer in adapter.moe_layers()}
    try:
        for batch in batches:
            outputs.clear()
            loss = next_token_loss(model(**batch).logits, batch["decoder_input_ids"])
            gradients = torch.autograd.grad(loss, list(outputs.values()))
            for layer, gradient in zip(outputs, gradients, strict=True):
                expected[layer].append(gradient.float().pow(2).mean(dim=-1).reshape(-1))
    finally:
        for handle in handles:
            handle.remove()
    fisher = block_output_fisher(tmp_path / "source", batches, tmp_path / "spill", progress=False)
    assert sorted(fisher) == adapter.moe_layers()
    for layer, values in expected.items():
        assert torch.cat(values).abs().max() > 0, layer
        torch.testing.assert_close(fisher[layer], torch.cat(values), rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("layer", [1, 5])
def test_merging_and_the_imatrix_count_the_tokens_the_stock_router_dispatches(adapter, model, layer):
    """With the sequences' lengths a token past its expert's capacity is no expert's: merging's routed-token counts
    (a group's too) and the imatrix's per-expert counts are the stock dispatch's."""
    from moecompress.export.imatrix import layer_statistics
    from moecompress.passes.expert_merge import merge_experts

    moe, *_ = _view(adapter, model, layer)
    hidden = torch.randn(3, 24, H, generator=torch.Generator().manual_seed(50 + layer))
    flat = hidden.reshape(-1, H)
    with torch.no_grad():
        dispatch = adapter.moe_block_of(model, layer).router(hidden)[0].reshape(-1, E)
    per_expert = dispatch.sum(dim=0)
    assert (dispatch.sum(dim=-1) == 0).any(), "the test's tokens must overflow an expert's capacity"
    lengths = [24] * 3
    _, singles = merge_experts(adapter, moe, [[e] for e in range(E)], flat, chunk_tokens=50, sequence_lengths=lengths)
    assert [report["tokens"] for report in singles] == per_expert.tolist()
    _, pair = merge_experts(adapter, moe, [[0, 1], [2], [3]], flat, sequence_lengths=lengths, refit=False)
    assert pair[0]["tokens"] == int(per_expert[:2].sum())
    stats = layer_statistics(adapter, layer, moe, flat, sequence_lengths=lengths)
    assert stats[f"blk.{layer}.ffn_up_exps.weight.counts"].tolist() == per_expert.double().tolist()
    flat_stats = layer_statistics(adapter, layer, moe, flat)
    assert flat_stats[f"blk.{layer}.ffn_up_exps.weight.counts"].sum() > per_expert.sum()


def test_the_router_refit_fits_and_measures_whole_sequences(adapter, model):
    """The refit's error is that of the view's forward of each sequence (capacity per sequence), and the rows it
    keeps lower it."""
    from moecompress.passes.router_refit import recalibrate_router

    layer = 5
    moe, *_ = _view(adapter, model, layer)
    hidden = torch.randn(4, 24, H, generator=torch.Generator().manual_seed(60))
    flat = hidden.reshape(-1, H)
    pruned = moe.select([1, 3])
    lengths = [24] * 4
    refit, report = recalibrate_router(
        adapter, moe, pruned, flat, steps=20, batch_tokens=48, eval_every=5, sequence_lengths=lengths
    )

    def error(candidate):
        with torch.no_grad():
            got = torch.cat([adapter.moe_forward(candidate, sequence) for sequence in hidden])
            want = torch.cat([adapter.moe_forward(moe, sequence) for sequence in hidden])
        return float((got - want).double().pow(2).sum() / want.double().pow(2).sum())

    assert report["error_before"] == pytest.approx(error(pruned), rel=1e-6)
    assert report["error_after"] == pytest.approx(error(refit), rel=1e-6)
    assert report["error_after"] < report["error_before"]


def test_quantized_experts_load_per_stack_and_take_the_one_hot_dispatch(tmp_path):
    """A quantised checkpoint names each stack's experts with its block's feed-forward (``layer.1`` / ``layer.2``)
    and loads through the plugin; each quantised block computes what the stock block computes with the dequantised
    experts, the tokens past an expert's capacity (an all-zero dispatch row) given nothing."""
    import transformers
    from synthetic import save_tiny_model

    import moecompress  # noqa: F401 - the plugin
    from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint

    source = save_tiny_model("switch_transformers", tmp_path / "source")
    quantize_checkpoint(source, tmp_path / "q", QuantizeConfig(scheme="mxfp4"), progress=False)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    adapter = adapter_for(config)
    assert set(config["quantization_config"]["modules"]) == {
        "encoder.block.1.layer.1.mlp.experts",
        "decoder.block.0.layer.2.mlp.experts",
        "decoder.block.1.layer.2.mlp.experts",
    }
    quantized = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "q", dtype=torch.float32).eval()
    stock = transformers.AutoModelForSeq2SeqLM.from_pretrained(source, dtype=torch.float32).eval()
    hidden = torch.randn(2, 96, 64, generator=torch.Generator().manual_seed(7))
    for layer in adapter.moe_layers():
        experts = adapter.experts_of(quantized, layer)
        assert type(experts).__name__ == "QuantizedExperts"
        with torch.no_grad():
            for expert in range(8):
                up, down = experts.expert_weights(expert, torch.float32)
                adapter.experts_of(stock, layer)[f"expert_{expert}"].wi.weight.copy_(up)
                adapter.experts_of(stock, layer)[f"expert_{expert}"].wo.weight.copy_(down)
            dispatch = adapter.moe_block_of(stock, layer).router(hidden)[0]
            want = adapter.moe_block_of(stock, layer)(hidden)
            got = adapter.moe_block_of(quantized, layer)(hidden)
        assert (dispatch.sum(dim=-1) == 0).any(), "the test's tokens must overflow an expert's capacity"
        assert got[dispatch.sum(dim=-1) == 0].abs().max() == 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
