"""Small helpers several test modules share."""

import hashlib
import os
import subprocess
import sys

CLI_COMMITTING_EVERY_LAYER = [
    sys.executable,
    "-c",
    "import moecompress.sweep.state as s; s.COMMIT_INTERVAL_S = 0.0; from moecompress.cli.main import main; main()",
]
"""The console entry point in a fresh interpreter whose sweeps commit after every layer (as in the tests' own
process, tests/conftest.py), so a test that kills it can kill it between any two layers."""


def run_cli(*args, env=None):
    """Run the real console entry point in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "moecompress.cli.main", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def checkpoint_adapter(directory):
    """The family adapter of the checkpoint in ``directory``, from its ``config.json``."""
    import json
    from pathlib import Path

    from moecompress.families import adapter_for

    return adapter_for(json.loads((Path(directory) / "config.json").read_text()))


def copy_with_tokenizer(checkpoint, directory):
    """A copy of the saved tiny checkpoint ``checkpoint`` at ``directory`` with the tiny tokenizer beside it (what a
    command that calibrates or evaluates reads)."""
    import shutil

    from synthetic import tiny_tokenizer

    shutil.copytree(checkpoint, directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def layer_split(source, layer):
    """The adapter of checkpoint ``source`` and layer ``layer`` read from disk and split by it: the MoE view, the
    layer's other tensors and the layout that joins them back."""
    from moecompress.checkpoint import CheckpointReader
    from moecompress.families import adapter_for

    with CheckpointReader(source) as reader:
        adapter = adapter_for(reader.config)
        prefix = adapter.layer_prefix(layer)
        moe, rest, layout = adapter.split_layer(layer, reader.read(k for k in reader.keys() if k.startswith(prefix)))
    return adapter, moe, rest, layout


def layer_view(source, layer):
    """The adapter of checkpoint ``source`` and layer ``layer``'s MoE view, read from disk."""
    adapter, moe, _, _ = layer_split(source, layer)
    return adapter, moe


def rewrite_checkpoint(source, out_dir, layer_fn=None, *, config=None, max_shard_bytes=None):
    """Copy checkpoint ``source`` into ``out_dir`` through the pipeline's writing loop
    (:func:`moecompress.runner.pipeline.write_model`) in the source's on-disk layout; returns the output directory.

    ``layer_fn(layer, moe)`` returns each MoE layer's replacement view; ``config`` replaces the source's config.json;
    ``max_shard_bytes`` bounds each shard (the writer's default when None)."""
    from pathlib import Path

    from moecompress.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES
    from moecompress.passes.base import LayerPass
    from moecompress.runner.pipeline import write_model

    class Rewrite(LayerPass):
        name = "rewrite"

        def rewrite(self, layer, block, capture):
            return block if block is None or layer_fn is None else layer_fn(layer, block)

        def finish_config(self, source_config):
            return source_config if config is None else config

    return write_model(
        Path(source),
        Path(out_dir),
        Rewrite(None),
        overwrite=False,
        progress=False,
        max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
    )


def model_layer_split(model, layer=0):
    """:func:`layer_split` of an in-memory ``model``, with the layer's tensors (copies) that were split."""
    from moecompress.families import adapter_for

    adapter = adapter_for(model.config.to_dict())
    prefix = adapter.layer_prefix(layer)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith(prefix)}
    moe, rest, layout = adapter.split_layer(layer, tensors)
    return adapter, moe, rest, layout, tensors


def tree_hashes(directory):
    """SHA-256 of every file directly inside ``directory``."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def load_stock(directory, dtype=None):
    """``directory``'s model built by plain transformers with the family's model class, in eval mode (for a
    family whose ``config.json`` names a model type transformers lacks, Kimi-K2, with the config it maps to)."""
    import torch
    import transformers

    adapter = checkpoint_adapter(directory)
    config = adapter.transformers_config()
    kwargs = {} if config is None else {"config": config}
    model = getattr(transformers, adapter.auto_class).from_pretrained(directory, dtype=dtype or torch.float32, **kwargs)
    return model.eval()


def plain_perplexity(directory, seq_len, tokens):
    """The evaluation's definition computed the obvious way on the model plain transformers loads (the held-out
    builtin prose in windows of ``seq_len``, up to ``tokens``); returns it and the model."""
    import math

    import torch
    import transformers

    from moecompress.calibration.builtin_corpus import builtin_documents

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = load_stock(directory)
    ids = []
    for doc in builtin_documents("prose", "heldout"):
        ids.extend(tokenizer(doc.text + "\n\n", add_special_tokens=False)["input_ids"])
    windows = torch.tensor([ids[i * seq_len : (i + 1) * seq_len] for i in range(min(len(ids), tokens) // seq_len)])
    if model.config.is_encoder_decoder:  # the decoder's targets on the windows' span corruption, drawn in turn
        from moecompress.calibration.span_corruption import seq2seq_windows
        from moecompress.evals.perplexity import SEQ2SEQ_SEED

        spans = seq2seq_windows(windows, torch.zeros_like(windows), tokenizer, model.config.to_dict(), SEQ2SEQ_SEED)
        rows = [
            dict(input_ids=source[None], decoder_input_ids=decoder[None], labels=labels[None])
            for source, decoder, labels in zip(spans.input_ids, spans.decoder_input_ids, spans.labels, strict=True)
        ]
    else:
        rows = [dict(input_ids=window[None], labels=window[None]) for window in windows]
    with torch.no_grad():
        losses = [model(**row).loss.item() for row in rows]
    return math.exp(sum(losses) / len(losses)), model


def stock_inputs(model, ids):
    """The forward's inputs for the token ids ``ids`` ``[B, S]``: an encoder-decoder's decoder reads them too."""
    if model.config.is_encoder_decoder:
        return {"input_ids": ids, "decoder_input_ids": ids}
    return {"input_ids": ids}


def assert_view_computes_the_stock_layer(adapter, model, layer, moe, hidden):
    """Layer ``layer``'s MoE view ``moe`` routes ``hidden`` ``[T, H]`` exactly as the stock ``model``'s router does,
    and its experts' combined output is the stock experts' (to float rounding)."""
    import torch

    _, weights, ids = adapter.stock_route(model, layer, hidden)
    view_ids, view_weights = adapter.routing_rule().route(adapter.router_logits(moe, hidden), moe.correction_bias)
    assert torch.equal(view_ids, ids) and torch.equal(view_weights, weights)
    stock = adapter.stock_experts(model, layer, hidden, ids, weights)
    view = adapter.combine_experts(hidden, ids, weights, lambda expert, x: adapter.expert_output(moe, expert, x))
    torch.testing.assert_close(view, stock, rtol=1e-5, atol=1e-5)


def token_batches():
    """Two calibration batches of 2 x 24 seeded random token ids, none a special token (0-2) or a tiny model's image,
    video or audio token (380 up)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(3, 380, (2, 24), generator=generator)} for _ in range(2)]


def text_sweep(checkpoint, batches, state=None, stop_after=None, consume=None):
    """The layer sweep of ``checkpoint`` over ``batches`` (every token a text token), resumed from ``state``, run to
    its end or to layer ``stop_after``'s capture; ``consume`` is given each capture."""
    import torch

    from moecompress.sweep.engine import CalibrationSweep

    tokens = sum(batch["input_ids"].numel() for batch in batches)
    sweep = CalibrationSweep(checkpoint, batches, torch.zeros(tokens, dtype=torch.long), ["text"], progress=False)
    for capture in sweep.run(state):
        if consume is not None:
            consume(capture)
        if capture.layer == stop_after:
            break
    return sweep


def stock_last_hidden(checkpoint, batches):
    """The stock model's last decoder layer's output hidden states, batch by batch."""
    import torch

    model = load_stock(checkpoint)
    layers = model.get_submodule(checkpoint_adapter(checkpoint).runtime_layers_path)
    outputs = []
    handle = layers[-1].register_forward_hook(lambda module, args, out: outputs.append(out[0]))
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    handle.remove()
    return outputs


def assert_sweep_equals_the_stock_forward(checkpoint, state=None):
    """The layer sweep's last hidden states over :func:`token_batches` (resumed from ``state``) are the stock
    forward's."""
    import torch

    batches = token_batches()
    sweep = text_sweep(checkpoint, batches, state)
    for swept, stock in zip(sweep.last_hidden, stock_last_hidden(checkpoint, batches), strict=True):
        torch.testing.assert_close(swept, stock, rtol=0, atol=1e-5)


def assert_delta_h_with_removed_experts(adapter, moe, hidden, removed, present):
    """ΔH scored with the experts ``removed`` (a mask over the routed experts) already gone: zero for those, and for
    every other expert the change of the block's output on ``hidden`` when it too leaves ``present`` (the mask of
    what stays routable)."""
    import torch

    from moecompress.passes.expert_scores import layer_expert_stats

    stats = layer_expert_stats(adapter, moe, hidden, chunk_tokens=64, removed=removed)
    full = adapter.moe_forward(moe, hidden, allowed=present)
    for e in range(len(removed)):
        if removed[e]:
            assert torch.all(stats.delta_h[:, e] == 0)
            continue
        without = present.clone()
        without[e] = False
        expected = (full - adapter.moe_forward(moe, hidden, allowed=without)).norm(dim=-1)
        torch.testing.assert_close(stats.delta_h[:, e], expected, rtol=1e-5, atol=1e-5)
