"""State that a decoder layer hands to later layers in the stock forward, carried by the layer sweep.

The sweep runs one layer at a time on each calibration batch with the call arguments the skeleton recorded, which
hold no such state (its proxies return their input). Two kinds are carried, per batch, as the adapter declares:

- an output of layer ``i`` that the stock forward passes to layer ``i + 1`` (``carried_outputs``: output position to
  keyword, or to an int, the position among the arguments after the hidden states; Mistral Large 4's and GLM-5's
  indexer top-k as ``prev_topk_indices``, ZAYA1's router state as argument 0), kept for the next layer only;
- a dictionary the stock forward threads through all layers (``shared_state_keyword``, Mistral Large 4's
  ``shared_kv_states``): each call gets a fresh one holding what the layer's sources
  (:meth:`~moecompress.families.FamilyAdapter.shared_state_sources`) wrote into theirs, and what a layer writes is kept
  until the last layer that names it as a source has run.

What it holds: per batch one top-k ``[B, S, min(index_topk, S)]`` int32 (at 16,384 calibration tokens in
256-token windows, 16 MiB in all, against 384 MiB for one layer's float32 hidden states at hidden size 6144) and each
live source's entries (Mistral Large 4: ``kv_lora_rank + qk_rope_head_dim`` = 576 values a token, 9% of a hidden
state). A layer run again (a replacement's recomputation) reads the same entries, as nothing is dropped before the
next layer.

A third kind, a stack of hidden states the stock forward builds between layers (``block_states_argument``, Inkling
2's ``block_states``): the input of every layer at a block boundary (:meth:`FamilyAdapter.is_block_boundary`) is
kept, per batch, and each later layer gets those of the boundaries before it stacked ``[B, S, n, H]`` at the
argument's position; the module after the layers (``block_states_reader``, Inkling 2's ``final_input``) gets them
all (:meth:`LayerCarry.final_stacks`). That is one hidden state per block boundary held to the end of the sweep:
``ceil(num_layers / n_layers_per_attn_res_block) x tokens x hidden x 4`` bytes in float32 (Inkling-2-Small: 8
boundaries of hidden size 4608, 144 KiB a token, 2.25 GiB at 16,384 calibration tokens), plus one batch's stack
built for the layer running.

An encoder-decoder (:meth:`FamilyAdapter.stack_starts`, Switch Transformers): the encoder's output after its final
norm, per batch (one hidden state per source token), is every decoder layer's cross-attention input
(``encoder_output_argument``); nothing a layer returns is carried into the first layer of the next stack (T5's
blocks hand their position biases on within a stack only).
"""

from __future__ import annotations

from typing import Any

import torch

from ..device import to_compute
from ..families import FamilyAdapter


class LayerCarry:
    def __init__(self, adapter: FamilyAdapter, batches: int):
        self.adapter = adapter
        self.outputs = dict(adapter.carried_outputs)
        self.keyword = adapter.shared_state_keyword
        self.entering: list[dict[int, dict[str, Any]]] = [{} for _ in range(batches)]
        """Per batch: layer → the keyword arguments carried into it."""
        self.stored: list[dict[int, dict[str, tuple[torch.Tensor, ...]]]] = [{} for _ in range(batches)]
        """Per batch: source layer → what it wrote into the shared dictionary."""
        self.block_argument = adapter.block_states_argument
        self.blocks: list[dict[int, torch.Tensor]] = [{} for _ in range(batches)]
        """Per batch: block-boundary layer → its input hidden states."""
        self.starts = set(adapter.stack_starts()) - {0}
        self.encoder_argument = adapter.encoder_output_argument
        self.encoder: list[torch.Tensor | None] = [None] * batches
        """Per batch: the encoder's normalised output, once the encoder has run."""
        self.last_reader: dict[int, int] = {}
        for layer in range(adapter.num_layers):
            for source in adapter.shared_state_sources(layer):
                self.last_reader[source] = max(self.last_reader.get(source, source), layer)

    @property
    def active(self) -> bool:
        return (
            bool(self.outputs)
            or self.keyword is not None
            or self.block_argument is not None
            or self.encoder_argument is not None
        )

    def encoder_output(self, batch: int, output: torch.Tensor) -> None:
        """Hold batch ``batch``'s encoder output for the later stacks' layers."""
        self.encoder[batch] = output

    def block_entries(self, batch: int, before: int | None = None) -> list[tuple[int, torch.Tensor]]:
        """Batch ``batch``'s kept block-boundary inputs, by layer, of the layers before ``before`` (all: None)."""
        held = self.blocks[batch]
        return [(layer, held[layer]) for layer in sorted(held) if before is None or layer < before]

    @staticmethod
    def stack(entries: list[torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """``entries`` stacked as the stock forward's ``block_states`` ``[B, S, n, H]`` beside ``hidden``."""
        if not entries:
            return hidden.new_zeros(*hidden.shape[:-1], 0, hidden.shape[-1])
        return torch.stack([to_compute(entry).to(hidden.dtype) for entry in entries], dim=-2)

    def positional(self, layer: int, batch: int, hidden: torch.Tensor, args: tuple) -> tuple:
        """``args`` (the recorded call's, after the hidden states) with the block stack and the positional outputs
        carried into ``layer``."""
        args = self.with_outputs(layer, batch, args)
        if self.encoder_argument is not None and self.encoder[batch] is not None:
            args = list(args)
            args[self.encoder_argument] = to_compute(self.encoder[batch]).to(hidden.dtype)
            args = tuple(args)
        if self.block_argument is None:
            return args
        args = list(args)
        args[self.block_argument] = self.stack([e for _, e in self.block_entries(batch, layer)], hidden)
        return tuple(args)

    def with_outputs(self, layer: int, batch: int, args: tuple) -> tuple:
        """``args`` with the outputs carried into ``layer`` at their positions (``carried_outputs``' int entries)."""
        carried = {pos: value for pos, value in self.entering[batch].get(layer, {}).items() if isinstance(pos, int)}
        if not carried:
            return args
        args = list(args)
        for pos, value in carried.items():
            args[pos] = value
        return tuple(args)

    def final_stacks(self, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Per batch, every kept block-boundary input stacked (what ``block_states_reader`` reads), or None."""
        if self.block_argument is None:
            return None
        return [self.stack([e for _, e in self.block_entries(b)], h) for b, h in enumerate(like)]

    def arguments(self, layer: int, batch: int, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` (the recorded call) with the state carried into layer ``layer`` for batch ``batch``."""
        if not self.active:
            return kwargs
        kwargs = {**kwargs, **{k: v for k, v in self.entering[batch].get(layer, {}).items() if isinstance(k, str)}}
        if self.keyword is not None and self.keyword in kwargs:
            shared = type(kwargs[self.keyword])()
            for source in self.adapter.shared_state_sources(layer):
                shared.update(self.stored[batch].get(source, {}))
            kwargs[self.keyword] = shared
        return kwargs

    def record(
        self, layer: int, batch: int, output: Any, kwargs: dict[str, Any], hidden: torch.Tensor | None = None
    ) -> None:
        """Keep what layer ``layer`` produced for batch ``batch`` (``kwargs``: the arguments it was called with,
        ``hidden``: its input hidden states)."""
        if not self.active:
            return
        if self.block_argument is not None and hidden is not None and self.adapter.is_block_boundary(layer):
            self.blocks[batch][layer] = hidden
        if self.outputs and isinstance(output, tuple) and layer + 1 not in self.starts:
            self.entering[batch][layer + 1] = {keyword: output[pos] for pos, keyword in self.outputs.items()}
        for earlier in [i for i in self.entering[batch] if i < layer]:
            del self.entering[batch][earlier]
        if self.keyword is not None and self.keyword in kwargs:
            read = {
                key for source in self.adapter.shared_state_sources(layer) for key in self.stored[batch].get(source, {})
            }
            written = {key: value for key, value in kwargs[self.keyword].items() if key not in read}
            if written and layer in self.last_reader:
                self.stored[batch][layer] = written
        for source in [s for s in self.stored[batch] if self.last_reader.get(s, s) < layer]:
            del self.stored[batch][source]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Everything held, flat, for a resumable sweep's commit."""
        out = {}
        for batch, entering in enumerate(self.entering):
            for layer, values in entering.items():
                for keyword, value in values.items():
                    if isinstance(value, torch.Tensor):
                        out[f"in/{batch}/{layer}/{keyword}"] = value.cpu()
        for batch, blocks in enumerate(self.blocks):
            for layer, value in blocks.items():
                out[f"blk/{batch}/{layer}"] = value.cpu()
        for batch, encoder in enumerate(self.encoder):
            if encoder is not None:
                out[f"enc/{batch}"] = encoder.cpu()
        for batch, stored in enumerate(self.stored):
            for source, entries in stored.items():
                for key, values in entries.items():
                    for index, value in enumerate(values):
                        out[f"kv/{batch}/{source}/{key}/{index}"] = value.cpu()
        return out

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hold what :meth:`tensors` returned (a resumed sweep)."""
        kv: dict[tuple[int, int, str], dict[int, torch.Tensor]] = {}
        for name, value in tensors.items():
            value = to_compute(value)
            kind, *parts = name.split("/")
            if kind == "in":
                batch, layer, keyword = int(parts[0]), int(parts[1]), parts[2]
                self.entering[batch].setdefault(layer, {})[int(keyword) if keyword.isdigit() else keyword] = value
            elif kind == "blk":
                self.blocks[int(parts[0])][int(parts[1])] = tensors[name]
            elif kind == "enc":
                self.encoder[int(parts[0])] = tensors[name]
            else:
                batch, source, key, index = int(parts[0]), int(parts[1]), parts[2], int(parts[3])
                kv.setdefault((batch, source, key), {})[index] = value
        for (batch, source, key), values in kv.items():
            self.stored[batch].setdefault(source, {})[key] = tuple(values[i] for i in sorted(values))
