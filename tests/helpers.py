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


def layer_view(source, layer):
    """The adapter of checkpoint ``source`` and layer ``layer``'s MoE view, read from disk."""
    from moecompress.checkpoint import CheckpointReader
    from moecompress.families import adapter_for

    with CheckpointReader(source) as reader:
        adapter = adapter_for(reader.config)
        prefix = adapter.layer_prefix(layer)
        moe, _, _ = adapter.split_layer(layer, reader.read(k for k in reader.keys() if k.startswith(prefix)))
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


def tree_hashes(directory):
    """SHA-256 of every file directly inside ``directory``."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def load_stock(directory, dtype=None):
    """``directory``'s model built by plain transformers with the family's model class, in eval mode (for a
    family whose ``config.json`` names a model type transformers lacks, Kimi-K2, with the config it maps to)."""
    import json
    from pathlib import Path

    import torch
    import transformers

    from moecompress.families import adapter_for

    adapter = adapter_for(json.loads((Path(directory) / "config.json").read_text()))
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
