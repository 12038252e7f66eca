"""Streamed evaluation: the model and its reference run side by side over the same windows, one decoder layer at
a time, so that evaluating needs the memory of a layer, not of two models.

Each model's decoder is planned once by a :class:`~moecompress.sweep.engine.CalibrationSweep` (its embeddings turn the
windows into the first layer's hidden states, and every layer's call arguments are recorded). Then, layer by
layer, the reference's layer is built from its checkpoint, run over every window and freed, and the model's
likewise; the routers' choices of the two are compared while both are at hand. Last, batch by batch, each model's
final norm and output projection turn its last hidden states into logits, whose NLL and KL are summed at once.

Held at any time: one decoder layer (its routed experts as stored, bf16 or packed, and converted to float32 one
expert at a time as the whole-model evaluation's float32 computes: :mod:`moecompress.sweep.view_experts`; the rest in
float32), both models' float32 hidden states of all windows (tokens x hidden x 4 B each), one batch's logits per
model, and, while planning and while computing the logits, the embeddings and output projection (at the end, both
models' at once). A layer runs over up to 16 windows at once (a quantised layer unpacks its experts once per call);
the logits are computed over fewer where the vocabulary is large.

A layer is built as the whole-model load builds it, with the same modules and the same math: stock layers,
MoE blocks and attention resized by :mod:`moecompress.plugin` for globally pruned and head-pruned checkpoints, and
the quantised twins of :mod:`moecompress.quantization.hf_quantizer` for the native format. The figures are those
of :func:`.perplexity.evaluate_windows` on the same windows and batches.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..calibration.batches import TokenWindows
from ..calibration.span_corruption import Seq2SeqWindows
from ..checkpoint import CheckpointReader
from ..checkpoint.reader import PendingTensor
from ..errors import UserInputError
from ..families import FamilyAdapter, MoEWeights, adapter_for
from ..progress import bar as progress_bar
from ..quantization.hf_quantizer import (
    QUANT_METHOD,
    MoecompressConfig,
    decode_salient_bitmaps,
    replace_quantized_modules,
)
from ..sweep.engine import CalibrationSweep, split_windows
from .perplexity import EvalResult, EvalTotals, forward_batches, moe_token_bytes, window_sums, windows_per_forward
from .routing import routing_agreement


def whole_model_reason(model_dir: Path) -> str | None:
    """Why ``model_dir`` cannot be evaluated layer by layer (it is then loaded whole), or None."""
    with CheckpointReader(model_dir) as reader:
        config = reader.config
    section = config.get("quantization_config")
    if not section:
        return None
    method = section.get("quant_method")
    if method != QUANT_METHOD:
        return f"its weights are {method}-quantised, which transformers' own quantizer loads"
    adapter = adapter_for(config, source=str(model_dir))
    outside = [name for name in section.get("modules", {}) if adapter.layer_of_key(name) is None]
    if outside:
        return f"it has quantised modules outside the decoder layers ({outside[0]})"
    return None


class _WidenedTensor(PendingTensor):
    """A pending checkpoint tensor that reads as ``dtype`` (when floating-point), converted as it is read."""

    def __init__(self, reader: CheckpointReader, key: str, dtype: torch.dtype):
        super().__init__(reader, key)
        stored = reader.dtype_of(key)
        self.stored_dtype = stored
        self.wide_dtype = dtype if stored.is_floating_point else stored

    @property
    def dtype(self) -> torch.dtype:
        return self.wide_dtype

    def load(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.wide_dtype, device="cpu")
        self.load_into(out)
        return out

    def load_into(self, out: torch.Tensor) -> None:
        if out.dtype == self.stored_dtype:
            self.reader.read_into(self.key, out, self.check_finite)
            return
        stored = torch.empty(self.shape, dtype=self.stored_dtype, device="cpu")
        self.reader.read_into(self.key, stored, self.check_finite)
        out.copy_(stored)


class _WideningReader:
    """The checkpoint reader, except that a layer's pending tensors read in the evaluation's float32: a layer's
    stacked experts are then allocated once, in float32, and filled expert by expert, instead of being stacked in
    the checkpoint's bf16 and converted (1.2 GB more for a Qwen3-30B-A3B layer)."""

    def __init__(self, reader: CheckpointReader, dtype: torch.dtype):
        self._reader, self._dtype = reader, dtype

    def __getattr__(self, name: str):
        return getattr(self._reader, name)

    def pending(self, keys, check_finite: bool = True) -> dict[str, PendingTensor]:
        return {key: _WidenedTensor(self._reader, key, self._dtype) for key in keys}


class LayerStream(CalibrationSweep):
    """One checkpoint's decoder over the evaluation batches: plan, build a layer, run it, free it."""

    def __init__(self, model_dir: Path, batches: list[dict[str, torch.Tensor]]):
        super().__init__(
            model_dir,
            batches,
            torch.zeros(0, dtype=torch.long, device="cpu"),
            [],
            progress=False,
        )
        section = self.reader.config.get("quantization_config")
        self.quantization = MoecompressConfig(**section) if section else None
        self._widening = _WideningReader(self.reader, self.dtype)

    def _read_layer(self, layer: int):
        """Experts that compute from the view (:mod:`moecompress.sweep.view_experts`) are read in their stored dtype and
        converted one expert at a time as they are used; a stock experts module's are read into float32."""
        if self._computes_from_view(layer):
            return super()._read_layer(layer)
        plain, self.reader = self.reader, self._widening
        try:
            return super()._read_layer(layer)
        finally:
            self.reader = plain

    def materialise(self, layer: int) -> tuple[torch.nn.Module, MoEWeights | None]:
        if self.quantization is None:
            return super().materialise(layer)
        return self._quantized_layer(layer), None

    def _quantized_layer(self, layer: int) -> torch.nn.Module:
        """Decoder layer ``layer`` of a native-format checkpoint, whose tensors are stored under their runtime
        names: the stock layer, its quantised modules swapped for their twins, every floating-point tensor in the
        dtype its module registered it with (what transformers' loader does)."""
        prefix = self.adapter.layer_prefix(layer)
        module = self.adapter.decoder_layers(self._meta_model)[layer]
        local = self.adapter.runtime_name_of_stored
        names = {local(name[len(prefix) :]): name for name in self.quantization.modules if name.startswith(prefix)}
        try:
            replace_quantized_modules(module, self.quantization, names, self.adapter)
        except ValueError as error:
            raise UserInputError(f"{self.model_dir}: {error}") from None
        expected = module.state_dict(keep_vars=True)
        read = self.reader.read(self.layer_keys.get(layer, []))
        state = {}
        stored = {local(k[len(prefix) :]): t for k, t in read.items()}
        for name, tensor in self.adapter.runtime_local_state(stored).items():
            target = expected.get(name)
            if target is not None and tensor.is_floating_point() and target.is_floating_point():
                tensor = tensor.to(target.dtype)
            state[name] = tensor
        try:
            module.load_state_dict(state, strict=True, assign=True)
            decode_salient_bitmaps(module)
        except (RuntimeError, ValueError) as error:
            detail = " ".join(str(error).split())[:300]
            raise UserInputError(f"{self.model_dir}: layer {layer} does not load ({detail})") from None
        return self.placed(module).eval()

    def advance(
        self, layer: int, hidden: list[torch.Tensor], routes: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], float]:
        """Layer ``layer``'s outputs (with what the stock forward adds between layers) for each batch, and the
        seconds its forward took; each batch's top-k expert ids, in original ids, are appended to ``routes``.

        A looped segment (:attr:`~moecompress.families.FamilyAdapter.loop_layers`) runs whole, every pass, at its
        first layer (the routes of all its layers and passes appended there); its other layers pass ``hidden``
        on."""
        loop = self.adapter.loop_layers if self.adapter.loop_passes > 1 else range(0)
        if layer in loop:
            return self._advance_loop(hidden, routes) if layer == loop.start else (hidden, 0.0)
        module, moe = self.materialise(layer)
        del moe
        handle = self._record_routes(layer, module, routes)
        start = time.perf_counter()
        try:
            outputs = self.forward_layer(module, layer, hidden)
        finally:
            if handle is not None:
                handle.remove()
        seconds = time.perf_counter() - start
        self.release(module)
        return self.next_inputs(layer, outputs), seconds

    def _record_routes(
        self, layer: int, module: torch.nn.Module, routes: list[torch.Tensor] | None
    ) -> torch.utils.hooks.RemovableHandle | None:
        """A hook on MoE layer ``layer``'s router in ``module`` that appends each batch's top-k expert ids, in
        original ids, to ``routes``; None where there are none to record."""
        if routes is None or not self.adapter.is_moe_layer(layer):
            return None
        id_map = torch.tensor(self.adapter.route_ids(layer), dtype=torch.long, device="cpu")

        def record(mod, args, output):
            ids = self.adapter.route_of(output)[2]
            routes.append(id_map[ids.reshape(-1, ids.shape[-1]).cpu()])

        router = self.adapter.runtime_in_layer(layer, self.adapter.router_module)
        return module.get_submodule(router).register_forward_hook(record)

    def _advance_loop(
        self, hidden: list[torch.Tensor], routes: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], float]:
        held, handles = {}, []
        for layer in self.adapter.loop_layers:
            module, moe = self.materialise(layer)
            del moe
            held[layer] = (module,)
            handle = self._record_routes(layer, module, routes)
            if handle is not None:
                handles.append(handle)
        start = time.perf_counter()
        try:
            outputs = self._loop_passes(held, hidden)
        finally:
            for handle in handles:
                handle.remove()
        seconds = time.perf_counter() - start
        for (module,) in held.values():
            self.release(module)
        return outputs, seconds


def _dense_token_bytes(adapter: FamilyAdapter) -> int:
    """What a token costs in a layer whose experts run on every token (Llama 4's stock module); 0 where the
    experts compute on the tokens routed to them, one expert at a time."""
    return moe_token_bytes(adapter) if adapter.moe_layers() and adapter.routing_rule().scales_input else 0


def _split_stacks(batches, stacks: list[torch.Tensor] | None, windows: int) -> list[torch.Tensor] | None:
    """A family's final block stacks cut as :func:`split_windows` cuts the hidden states."""
    return None if stacks is None else split_windows(batches, stacks, windows)[1]


def _vocab(adapter: FamilyAdapter) -> int:
    return int(adapter.text_config["vocab_size"])


def evaluate_streamed(
    model_dir: Path,
    windows: TokenWindows | Seq2SeqWindows,
    reference_dir: Path | None = None,
    progress: bool = True,
) -> EvalResult:
    """Evaluate ``model_dir`` (against ``reference_dir``) on ``windows``, one decoder layer at a time."""
    with CheckpointReader(model_dir) as reader:
        adapter = adapter_for(reader.config, source=str(model_dir))
    vocab = _vocab(adapter)
    if reference_dir is not None:
        with CheckpointReader(reference_dir) as reader:
            ref_adapter = adapter_for(reader.config, source=str(reference_dir))
        ref_vocab = _vocab(ref_adapter)
        if ref_vocab != vocab:
            raise UserInputError(f"model and reference vocabularies differ ({vocab} vs {ref_vocab})")
    seq_len = windows.input_ids.shape[1]
    token_bytes = max(_dense_token_bytes(adapter), _dense_token_bytes(ref_adapter) if reference_dir is not None else 0)
    # A layer runs over as many windows at once as the experts allow (a quantised layer unpacks its experts once
    # per call); the logits are computed over fewer where the vocabulary is large.
    batches = list(forward_batches(windows, windows_per_forward(seq_len, 1, token_bytes)))
    head_windows = windows_per_forward(seq_len, vocab, token_bytes)
    model = LayerStream(model_dir, batches)
    reference = LayerStream(reference_dir, batches) if reference_dir is not None else None
    hidden = [plan.hidden for plan in model.plans]
    ref_hidden = [plan.hidden for plan in reference.plans] if reference is not None else None
    totals = EvalTotals()
    layers = max(model.adapter.num_layers, reference.adapter.num_layers if reference is not None else 0)
    for layer in progress_bar(range(layers), desc="eval", unit="layer", disable=not progress):
        compare = (
            reference is not None
            and layer < reference.adapter.num_layers
            and layer < model.adapter.num_layers
            and reference.adapter.is_moe_layer(layer)
            and model.adapter.is_moe_layer(layer)
        )
        ref_routes: list[torch.Tensor] = []
        routes: list[torch.Tensor] = []
        if reference is not None and layer < reference.adapter.num_layers:
            ref_hidden, _ = reference.advance(layer, ref_hidden, ref_routes if compare else None)
        if layer < model.adapter.num_layers:
            hidden, seconds = model.advance(layer, hidden, routes if compare else None)
            totals.model_seconds += seconds
        for ref_ids, ids in zip(ref_routes, routes, strict=compare):
            totals.add_agreement(*routing_agreement({layer: ref_ids}, {layer: ids}))
    stacks = _split_stacks(batches, model.final_block_states(hidden), head_windows)
    head_batches, hidden = split_windows(batches, hidden, head_windows)
    heads = model.text_head_logits(head_batches, hidden, stacks)
    ref_heads = None
    if reference is not None:
        ref_stacks = _split_stacks(batches, reference.final_block_states(ref_hidden), head_windows)
        _, ref_hidden = split_windows(batches, ref_hidden, head_windows)
        ref_heads = reference.text_head_logits(head_batches, ref_hidden, ref_stacks)
    with torch.inference_mode():
        for batch in head_batches:
            start = time.perf_counter()
            logits = next(heads)
            totals.model_seconds += time.perf_counter() - start
            totals.add(window_sums(batch, logits, next(ref_heads) if ref_heads is not None else None))
            del logits
    for generator in (heads, ref_heads):
        if generator is not None:
            generator.close()
    return totals.result(windows, with_reference=reference is not None)
