"""The layer-wise calibration sweep: hidden states flow through the decoder one materialised layer at a time.

How the inputs of each layer are obtained without holding the model: the model is built with zero decoder
layers (embeddings, vision tower, rotary tables are real and loaded from the checkpoint) and given one identity
*proxy* per layer. One forward of that skeleton per calibration batch records, for every layer, exactly the
keyword arguments the stock forward passes it (causal or sliding masks, rotary tables, position ids) and anything
the stock forward adds to the residual stream between layers (Qwen3-VL's deepstack features). The sweep then
runs the real layers itself, one at a time, so peak memory is the skeleton plus one layer plus the activations.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..calibration.span_corruption import DECODER_TAGS, model_inputs
from ..checkpoint import CheckpointReader, group_keys_by_layer
from ..checkpoint.stock_model import stock_config, stock_failures
from ..device import HOST, compute_device, host_buffer, is_accelerated, to_compute
from ..errors import UserInputError
from ..families import FamilyAdapter, MoEWeights, adapter_for
from ..memory import release_freed_memory
from ..progress import bar as progress_bar
from .attention_replay import AttentionReplay
from .layer_carry import LayerCarry
from .state import LayerResult, SweepState
from .view_experts import ExpertSource, ViewExperts, install, release_all, takes_routed_tokens


@dataclass
class LayerCapture:
    """What one MoE layer saw during calibration, all tokens of all batches flattened to ``T``.

    Its tensors (``moe``, ``moe_input``, ``attention_received``) are released (set to ``None``) when the consumer
    asks for the next layer, so that a consumer still holding the capture does not hold a second layer's experts."""

    layer: int
    moe: MoEWeights | None
    moe_input: torch.Tensor | None
    tags: torch.Tensor
    tag_names: list[str]
    attention_received: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    result: LayerResult | None = None
    """Set by the consumer when the sweep is resumable: what a resumed run needs of this layer's work (it is
    committed with the layer's output hidden states)."""
    replacement: MoEWeights | None = None
    """Set by the consumer before it asks for the next layer: the block's new weights (e.g. quantised), through
    which the sweep then recomputes this layer's outputs, so later layers calibrate on what they will really
    receive (sequential calibration)."""
    allowed: torch.Tensor | None = None
    """With a ``replacement``: the experts (bool ``[E]``) its router may choose; the others are routed around as the
    family's rule does when an expert is removed. A pruned block is recomputed at its original size this way, so
    that the stock layer module (built for ``E`` experts) computes what the pruned model will."""
    router: MoEWeights | None = None
    """With a ``replacement``: a block of the original's size whose router tensors (rows, biases, correction bias,
    expert scale) the layer routes with from then on (a merged or refitted router); None keeps the original's."""
    rest: dict[str, torch.Tensor] | None = None
    """With ``keep_tensors``: the layer's other tensors (attention, norms, shared experts) as read, for a writer."""
    layout: Any = None
    """With ``keep_tensors``: the on-disk layout of the layer's experts (:meth:`FamilyAdapter.split_layer`)."""
    router_input: torch.Tensor | None = None
    """What the router's weight multiplied, token for token with ``moe_input``, where the family's router reads
    another input than the experts (:attr:`FamilyAdapter.router_input_module`); None: the router reads
    ``moe_input``."""
    token_ids: torch.Tensor | None = None
    """The calibration tokens' ids ``[T]``, token for token with ``moe_input``, where the block is hash-routed
    (:attr:`MoEWeights.token_table`): what its table routes by."""
    sequence_lengths: list[int] | None = None
    """The tokens of each sequence of ``moe_input``, in order, where the family routes whole sequences
    (:attr:`FamilyAdapter.per_sequence_routing`)."""
    keep: list[int] | None = None
    """Set in the pipeline's measuring sweep by a pass that knows from this layer alone which experts the layer keeps
    (layer-scope pruning): the positions, for the later passes to measure only those."""


class _LayerProxy(torch.nn.Module):
    """Stands in for decoder layer ``index`` in the skeleton: records its call, returns its input."""

    def __init__(self, index: int, recorder: _CallRecorder, attributes: dict[str, Any], extras: int | None = None):
        super().__init__()
        self.index = index
        self.recorder = recorder
        self.extras = extras
        """None: the layer returns its hidden states alone; else that many ``None`` after them."""
        for name, value in attributes.items():
            setattr(self, name, value)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.recorder.record(self.index, hidden_states, args, kwargs)
        out = self.recorder.outputs.get(self.index, hidden_states)
        return out if self.extras is None else (out, *[None] * self.extras)


class _CallRecorder:
    def __init__(self) -> None:
        self.calls: dict[int, tuple[tuple, dict]] = {}
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        """What a proxy returns instead of its input (the decoder's last hidden states, for :meth:`head_logits`)."""

    def record(self, index: int, hidden: torch.Tensor, args: tuple, kwargs: dict) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "use_cache")}
        self.calls[index] = (args, kwargs)
        self.inputs[index] = hidden


@dataclass
class _BatchPlan:
    """Per calibration batch: the layer-0 input, each layer's call arguments, between-layer additions."""

    hidden: torch.Tensor
    calls: dict[int, tuple[tuple, dict]]
    injections: dict[int, torch.Tensor]
    stack_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    """An encoder-decoder's later stacks' first inputs (the decoder's embedded tokens), by layer."""


def _text_config(config):
    return getattr(config, "text_config", None) or config


def _layer_attributes(layer: torch.nn.Module) -> dict[str, Any]:
    """Plain attributes of a decoder layer the stock forward reads from the layer itself (GPT-OSS's
    ``attention_type``, Nemotron-H's ``block_type``, Inkling 2's ``is_block_boundary``)."""
    names = ("attention_type", "block_type", "is_block_boundary")
    return {name: getattr(layer, name) for name in names if hasattr(layer, name)}


class CalibrationSweep:
    """Stream calibration batches through a checkpoint's decoder, one layer at a time.

    ``batches`` are keyword arguments of the model's forward (``input_ids``; for vision-language models also
    ``pixel_values``, ``image_grid_thw``, ``attention_mask``); ``tags`` is ``[N, L]`` tag indices aligned with
    the concatenated ``input_ids``.

    With ``moe_in_compute_dtype`` each capture's MoE view holds the routed experts in the sweep's ``dtype``, the
    very tensors the stock layer computes with, instead of a second copy in the checkpoint's dtype. That is one
    copy of a layer's experts fewer (1.2 GB on Qwen3-30B-A3B); for consumers that only read the weights
    (converting the checkpoint's bf16 to float32 is exact, so they see the same values). Consumers that write the
    view's tensors out keep the default, so that their output keeps the checkpoint's dtype.

    With ``keep_tensors`` (a consumer that writes the layer, as the pipeline's rewriting sweep) :meth:`run` yields
    every decoder layer, dense ones too (``moe`` None), each with its other tensors and layout, so the layer is read
    from the checkpoint once for calibrating and writing.

    With ``replaces`` the consumer sets a ``replacement`` on every MoE layer's capture (a sequential rewriting
    sweep), so the outputs of the original block are never used: the forward that captures the block's inputs
    skips its routed experts (where they run as a :class:`ViewExperts`), and a layer left without a replacement is
    run again in full.
    """

    def __init__(
        self,
        model_dir: Path,
        batches: list[dict[str, torch.Tensor]],
        tags: torch.Tensor,
        tag_names: list[str],
        *,
        capture_attention: bool = False,
        dtype: torch.dtype = torch.float32,
        moe_in_compute_dtype: bool = False,
        keep_tensors: bool = False,
        replaces: bool = False,
        last_outputs_unused: bool = False,
        progress: bool = True,
        decoder_tags: torch.Tensor | None = None,
    ):
        import transformers

        self.model_dir = Path(model_dir)
        self.reader = CheckpointReader(model_dir)
        self.adapter: FamilyAdapter = adapter_for(self.reader.config, source=str(model_dir))
        self.tags = tags.reshape(-1)
        if decoder_tags is None and batches and all(DECODER_TAGS in batch for batch in batches):
            decoder_tags = torch.cat([batch[DECODER_TAGS].reshape(-1) for batch in batches])
        batches = [model_inputs(batch) for batch in batches]
        self.decoder_tags = None if decoder_tags is None else decoder_tags.reshape(-1)
        """An encoder-decoder's tags of its decoder's tokens (``decoder_input_ids``; ``tags``: the encoder's), given
        or taken out of the batches (:mod:`~moecompress.calibration.span_corruption`'s ``DECODER_TAGS``)."""
        self.tag_names = tag_names
        self.token_ids = (
            torch.cat([batch["input_ids"].reshape(-1) for batch in batches])
            if batches and all("input_ids" in batch for batch in batches)
            else None
        )
        """The batches' token ids in the order the layers' inputs are captured (what a hash-routed block needs)."""
        self.capture_attention = capture_attention
        self.dtype = dtype
        self.moe_in_compute_dtype = moe_in_compute_dtype
        self.keep_tensors = keep_tensors
        self.replaces = replaces
        self.last_outputs_unused = last_outputs_unused
        """Set by a consumer that reads no outputs of the last decoder layer (no MTP layer follows): its rewritten
        block is not recomputed, and :attr:`last_hidden` stays None."""
        self.progress = progress
        self.layer_keys, outside_keys = group_keys_by_layer(self.reader, self.adapter)

        config = stock_config(self.model_dir, self.adapter)
        auto_class = getattr(transformers, self.adapter.auto_class)
        building = stock_failures(self.model_dir, f"build the {self.adapter.family} model from config.json")
        with building, torch.device("meta"):
            self._meta_model = _meta_model(auto_class, config, dtype, "eager" if capture_attention else "sdpa")
        self._config = config
        self._auto_class = auto_class
        self._outside_keys = outside_keys
        self._on_device: dict[int, torch.Tensor] = {}
        accepted = inspect.signature(self._meta_model.forward).parameters
        self._one_logit = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
        """Planning needs the layers' inputs, not the logits: a 151,936-token head over a batch is 1.2 GB."""
        skeleton, recorder = self._skeleton()
        self.plans = self._plan(skeleton, recorder, batches)
        self.carry = LayerCarry(self.adapter, len(self.plans))
        norm = self.adapter.encoder_output_norm
        self.encoder_norm = skeleton.get_submodule(norm) if norm is not None else None
        messages = self.adapter.message_input_module
        self._message_input = skeleton.get_submodule(messages) if messages is not None else None
        self._loop_messages: list[torch.Tensor | None] | None = None
        """While a looped segment runs (:meth:`_loop_passes`): per batch, the messages of the layer running."""
        del skeleton

    def _skeleton(self) -> tuple[torch.nn.Module, _CallRecorder]:
        """The model with zero decoder layers and a proxy in each layer's place, its outside tensors loaded."""
        from transformers.initialization import no_init_weights

        config, auto_class, dtype = self._config, self._auto_class, self.dtype
        meta_layers = self.adapter.decoder_layers(self._meta_model)
        from accelerate import init_empty_weights

        skeleton_config = copy.deepcopy(config)
        _text_config(skeleton_config).num_hidden_layers = 0
        with no_init_weights(), torch.device(HOST), init_empty_weights(include_buffers=False):
            skeleton = auto_class.from_config(skeleton_config, dtype=dtype)
        # The config's own count, not len(meta_layers): LongCat-Flash counts two per decoder layer.
        _text_config(skeleton.config).num_hidden_layers = _text_config(config).num_hidden_layers
        self.adapter.fix_skeleton(skeleton)
        recorder = _CallRecorder()
        layers_path = self.adapter.runtime_layers_path
        extras = self.adapter.layer_output_extras if self.adapter.layer_returns_tuple else None
        proxies = [_LayerProxy(i, recorder, _layer_attributes(layer), extras) for i, layer in enumerate(meta_layers)]
        starts = [*self.adapter.stack_starts(), len(proxies)]
        for path, start, end in zip(self.adapter.layer_stacks or (layers_path,), starts[:-1], starts[1:], strict=True):
            parent_path, _, attr = path.rpartition(".")
            setattr(skeleton.get_submodule(parent_path), attr, torch.nn.ModuleList(proxies[start:end]))
        ignored = [re.compile(p) for p in getattr(skeleton, "_keys_to_ignore_on_load_unexpected", None) or []]
        # As transformers, ignore only keys the model lacks (Unlimited-OCR's base model ignores "lm_head", which its
        # conditional-generation class has).
        own = set(skeleton.state_dict())
        keys = [
            key
            for key in self._outside_keys
            if self.adapter.runtime_module_name(key) in own or not any(p.search(key) for p in ignored)
        ]
        head_key = _untied_head_key(skeleton)
        stored = self.adapter.runtime_outside_state(self.reader.read(keys))
        state = {}
        for key in list(stored):
            tensor = stored.pop(key)
            keep = key == head_key and tensor.element_size() == 2 and dtype.itemsize > 2
            state[key] = tensor.to(dtype) if tensor.is_floating_point() and not keep else tensor
            del tensor
        _, unexpected = skeleton.load_state_dict(state, strict=False, assign=True)
        if unexpected:
            raise UserInputError(
                f"{self.model_dir}: tensors the {self.adapter.family} model does not have: {unexpected[:5]}"
            )
        skeleton.tie_weights()
        _fill_missing_parameters(skeleton, dtype)
        head = skeleton.get_output_embeddings()
        if head_key is not None and isinstance(head, torch.nn.Linear) and head.weight.dtype != dtype:
            skeleton.set_output_embeddings(UpcastingHead(head))
        skeleton.eval()
        return skeleton, recorder

    def _plan(self, skeleton: torch.nn.Module, recorder: _CallRecorder, batches) -> list[_BatchPlan]:
        plans = []
        num_layers = self.adapter.num_layers
        with torch.no_grad():
            for batch in batches:
                recorder.calls, recorder.inputs = {}, {}
                skeleton(**batch, use_cache=False, **self._one_logit)
                injections, stack_inputs = {}, {}
                for i in range(num_layers - 1):
                    if i + 1 in self.adapter.stack_starts():
                        stack_inputs[i + 1] = recorder.inputs[i + 1]
                        continue
                    delta = recorder.inputs[i + 1] - recorder.inputs[i]
                    if torch.count_nonzero(delta):
                        injections[i] = delta
                calls = dict(recorder.calls)
                position = self.adapter.block_states_argument
                if position is not None:
                    # The skeleton's stacks hold its proxies' inputs; the carry builds the real ones.
                    calls = {i: ((*a[:position], None, *a[position + 1 :]), k) for i, (a, k) in calls.items()}
                plans.append(_BatchPlan(recorder.inputs[0], calls, injections, stack_inputs))
        return plans

    def final_block_states(self, last_hidden: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Per batch, once every layer has run, the block stack the module after the layers reads
        (:attr:`~moecompress.families.FamilyAdapter.block_states_reader`); None for a family without one."""
        return self.carry.final_stacks(last_hidden)

    def head_logits(
        self,
        batches: list[dict[str, torch.Tensor]],
        last_hidden: list[torch.Tensor],
        block_states: list[torch.Tensor] | None = None,
    ) -> Iterator[torch.Tensor]:
        """Per calibration batch, the logits the stock forward computes from ``last_hidden`` (the last decoder
        layer's output; it may require grad): the final norm and output projection, whatever the family adds.
        ``block_states``: per batch, the stack the family's ``block_states_reader`` reads (it may require grad;
        :meth:`final_block_states`).

        The skeleton is built again for this and freed after, as it holds the embeddings and output projection."""
        skeleton, recorder = self._skeleton()
        skeleton.requires_grad_(False)
        device = compute_device()
        _move(skeleton, device)
        last = self.adapter.num_layers - 1
        current: dict[str, torch.Tensor] = {}
        hook = None
        if block_states is not None:
            reader = skeleton.get_submodule(self.adapter.block_states_reader)
            hook = reader.register_forward_pre_hook(lambda module, args: (current["stack"], *args[1:]))
        try:
            for index, (batch, hidden) in enumerate(zip(batches, last_hidden, strict=True)):
                if block_states is not None:
                    current["stack"] = to_compute(block_states[index])
                recorder.outputs = {last: to_compute(hidden)}
                batch = {
                    key: to_compute(value) if isinstance(value, torch.Tensor) else value
                    for key, value in model_inputs(batch).items()
                }
                yield skeleton(**batch, use_cache=False).logits
        finally:
            if hook is not None:
                hook.remove()
            recorder.outputs = {}
            current.clear()
            del skeleton
            release_freed_memory()

    def text_head_logits(
        self,
        batches: list[dict[str, torch.Tensor]],
        last_hidden: list[torch.Tensor],
        block_states: list[torch.Tensor] | None = None,
    ) -> Iterator[torch.Tensor]:
        """:meth:`head_logits` for text-only batches (``input_ids``), without the input embeddings when the output
        projection has its own weights: the skeleton is fed zero embeddings (the last layer's proxy returns the
        real hidden states), so a head never holds the embedding matrix too (1.2 GB in float32 for
        Qwen3-30B-A3B), and an evaluation can hold two models' heads together for the KL."""
        embeddings = self._meta_model.get_input_embeddings()
        output = self._meta_model.get_output_embeddings()
        if output is None or output.weight is embeddings.weight or self.adapter.reads_token_ids:
            yield from self.head_logits(batches, last_hidden, block_states)
            return
        name = next(name for name, param in self._meta_model.named_parameters() if param is embeddings.weight)
        saved, self._outside_keys = self._outside_keys, [key for key in self._outside_keys if key != name]
        hidden_size = int(self.adapter.text_config["hidden_size"])
        try:
            zero_batches = (
                {
                    **{key: value for key, value in batch.items() if key != "input_ids"},
                    "inputs_embeds": torch.zeros(*batch["input_ids"].shape, hidden_size, dtype=self.dtype),
                }
                for batch in batches
            )
            yield from self.head_logits(zero_batches, last_hidden, block_states)
        finally:
            self._outside_keys = saved

    def materialise(self, layer: int) -> tuple[torch.nn.Module, MoEWeights | None]:
        """Decoder layer ``layer`` as the stock module with the checkpoint's weights (in the sweep's dtype), and
        the view of its MoE block (``None`` for a dense layer); :meth:`release` frees the module."""
        module, moe, _, _ = self._materialise(layer)
        return module, moe

    def _read_layer(self, layer: int) -> tuple[MoEWeights | None, dict[str, torch.Tensor], Any, dict]:
        """Layer ``layer``'s tensors read from the checkpoint to the host: the MoE view, the other tensors, the
        layout and the runtime state of the stock module (what the prefetch thread does ahead of the device)."""
        tensors = self.reader.pending(self.layer_keys.get(layer, []))
        moe, rest, layout = self.adapter.split_layer(layer, tensors, consume=True)
        if moe is not None and self.moe_in_compute_dtype:
            _convert_in_turn(moe, self.dtype)
        state = self.adapter.runtime_layer_state(layer, moe, rest)
        if moe is not None and self._computes_from_view(layer):
            experts = f"{self.adapter.runtime_in_layer(layer, self.adapter.experts_module)}."
            state = {k: v for k, v in state.items() if not k.startswith(experts)}
        state = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in state.items()}
        return moe, rest, layout, state

    def _computes_from_view(self, layer: int) -> bool:
        """Whether layer ``layer``'s routed experts run as a :class:`ViewExperts` on the view's own tensors
        instead of a float32 copy loaded into the stock module."""
        module = self.adapter.decoder_layers(self._meta_model)[layer]
        if not self.adapter.is_moe_layer(layer):
            return False
        experts = getattr(self._experts_parent(module, layer), "experts", None)
        return experts is not None and takes_routed_tokens(experts)

    def _experts_parent(self, module: torch.nn.Module, layer: int) -> torch.nn.Module:
        return module.get_submodule(self.adapter.runtime_in_layer(layer, self.adapter.experts_parent))

    def _materialise(self, layer: int) -> tuple[torch.nn.Module, MoEWeights | None, dict[str, torch.Tensor], Any]:
        prefetched = self._prefetched.pop(layer, None) if hasattr(self, "_prefetched") else None
        moe, rest, layout, state = prefetched.result() if prefetched is not None else self._read_layer(layer)
        module = self.adapter.decoder_layers(self._meta_model)[layer]
        if moe is not None and self._computes_from_view(layer):
            install(self._experts_parent(module, layer), self.adapter).source = ExpertSource(moe)
        try:
            module.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as error:
            detail = " ".join(str(error).split())[:300]
            raise UserInputError(
                f"{self.model_dir}: layer {layer} weights do not match config.json ({detail})"
            ) from None
        return self.placed(module).eval(), moe, rest, layout

    def placed(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` on the compute device (its host tensors are freed as they move; a :class:`ViewExperts`'s
        view is copied there), its buffers that no checkpoint holds made first."""
        _initialise_meta_buffers(module, self._meta_model)
        if not is_accelerated():
            return module
        device = compute_device()
        for child in module.modules():
            if isinstance(child, ViewExperts) and child.source is not None:
                child.source = child.source.to(device)
        return module.to(device)

    def prefetch(self, layer: int) -> None:
        """Start reading layer ``layer`` while the current one computes: on an accelerator on a background thread
        into memory; on the CPU only into the page cache (:meth:`CheckpointReader.advise`: on 2 cores a reading
        thread competes with the compute and did not pay, the kernel's read-ahead takes no CPU)."""
        if not 0 <= layer < self.adapter.num_layers:
            return
        if not is_accelerated():
            self.reader.advise(self.layer_keys.get(layer, []))
            return
        if not hasattr(self, "_prefetched"):
            self._prefetched: dict[int, Future] = {}
            self._reading = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moecompress-prefetch")
        if layer not in self._prefetched:
            self._prefetched[layer] = self._reading.submit(self._read_layer, layer)

    def call_arguments(self, layer: int, batch: int) -> tuple[tuple, dict]:
        """Layer ``layer``'s recorded call arguments for batch ``batch`` (masks, rotary tables), on the compute
        device; moved once and kept, as consecutive layers share them."""
        args, kwargs = self.plans[batch].calls[layer]
        if not is_accelerated():
            return args, kwargs
        return tuple(self._moved(a) for a in args), {key: self._moved(value) for key, value in kwargs.items()}

    def _moved(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in self._on_device:
                self._on_device[id(value)] = to_compute(value)
            return self._on_device[id(value)]
        if isinstance(value, tuple):
            return tuple(self._moved(item) for item in value)
        return value

    def _load_moe(
        self, module: torch.nn.Module, layer: int, moe: MoEWeights | ExpertSource, original: MoEWeights
    ) -> None:
        """Compute layer ``layer``'s routed experts with ``moe`` from now on (the router stays the original's)."""
        experts = getattr(self._experts_parent(module, layer), "experts", None)
        if isinstance(experts, ViewExperts):
            source = moe if isinstance(moe, ExpertSource) else ExpertSource(moe)
            experts.source = source.to(compute_device()) if is_accelerated() else source
            return
        if isinstance(moe, ExpertSource):
            moe = moe.padded(original)
        self._load_state(module, layer, self.adapter.runtime_moe_state(moe), "replacement")

    def _load_router(self, module: torch.nn.Module, layer: int, router: MoEWeights) -> None:
        """Route layer ``layer`` with ``router``'s router tensors from now on."""
        self._load_state(module, layer, self.adapter.runtime_router_state(router), "router")

    def _load_state(self, module: torch.nn.Module, layer: int, state: dict[str, torch.Tensor], what: str) -> None:
        state = {key: value.to(self.dtype) if value.is_floating_point() else value for key, value in state.items()}
        _, unexpected = module.load_state_dict(state, strict=False, assign=True)
        if unexpected:
            raise RuntimeError(f"layer {layer}: {what} tensors the layer lacks: {unexpected[:5]}")
        self.placed(module)

    @staticmethod
    def release(module: torch.nn.Module) -> None:
        """Return a materialised layer's memory (its module goes back to the meta device)."""
        release_all(module)
        module.to("meta")
        release_freed_memory()

    def run(self, state: SweepState | None = None, label: str = "calibration") -> Iterator[LayerCapture]:
        """Yield a :class:`LayerCapture` for every MoE layer, in order (the measuring sweep).

        Each layer's outputs, computed with its original weights (or with the ``replacement`` the consumer set on
        the capture), become the next layer's inputs. With a ``state`` every finished layer is committed to it
        (outputs and the consumer's ``result``), and a state that holds commits resumes after the last one: the
        layers before are not run again (their results are in ``state.results()``).
        """
        hidden = [plan.hidden for plan in self.plans]
        start = 0
        if state is not None and state.last_layer is not None:
            hidden, start = state.hidden(), state.start_layer
            self.carry.restore(state.carried())
        layers = range(start, self.adapter.num_layers)
        loop = self.adapter.loop_layers if self.adapter.loop_passes > 1 else range(0)
        for layer in progress_bar(layers, desc=label, unit="layer", disable=not self.progress, initial=start):
            if layer in loop:
                if layer == loop.start:
                    hidden = yield from self._looped_segment(hidden, state)
                continue
            if self.keep_tensors:
                module, moe, rest, layout = self._materialise(layer)
            else:
                (module, moe), rest, layout = self.materialise(layer), None, None
            self.prefetch(layer + 1)
            captured_inputs: list[torch.Tensor] = []
            lengths: list[int] | None = [] if self.adapter.per_sequence_routing else None
            router_inputs: list[torch.Tensor] = []
            received: list[torch.Tensor] = []
            extra: dict[str, Any] = {}
            handles = []
            if moe is not None:
                site = self.adapter.runtime_in_layer(layer, self.adapter.moe_site_module)
                handles.append(_capture_input(module.get_submodule(site), captured_inputs, lengths))
                handles += self.adapter.attention_expert_hooks(module, extra)
                if self.adapter.router_input_module:
                    router = module.get_submodule(
                        self.adapter.runtime_in_layer(layer, self.adapter.router_input_module)
                    )
                    handles.append(_capture_input(router, router_inputs))
                if self.capture_attention and self.adapter.softmax_attention(layer):
                    handles.append(
                        module.get_submodule(self.adapter.attention_module).register_forward_hook(
                            lambda mod, args, out, into=received, at=self.adapter.attention_weights_output: into.append(
                                _attention_received(out[at])
                            )
                        )
                    )
            skipped = self._skipped_experts(module, layer) if moe is not None else None
            replay = self._attention_replay(module, layer) if skipped is not None else None
            outputs = self.forward_layer(module, layer, hidden)
            for handle in handles:
                handle.remove()
            if replay is not None:
                replay.stop_watching()
            if skipped is not None:
                skipped.outputs_unused = False
            result = None
            if moe is not None or self.keep_tensors:
                capture = LayerCapture(
                    layer=layer,
                    moe=moe,
                    moe_input=torch.cat(captured_inputs).float() if captured_inputs else None,
                    tags=self.tags_of(layer),
                    tag_names=self.tag_names,
                    attention_received=torch.cat(received).cpu() if received else None,
                    rest=rest,
                    layout=layout,
                    router_input=torch.cat(router_inputs).float() if router_inputs else None,
                    token_ids=self.token_ids if moe is not None and moe.token_table is not None else None,
                    sequence_lengths=lengths if moe is not None else None,
                    extra=extra,
                )
                del captured_inputs, router_inputs, received, rest
                yield capture
                unused = self.last_outputs_unused and layer == self.adapter.num_layers - 1
                if capture.replacement is not None and not unused:
                    self._load_moe(module, layer, capture.replacement, capture.moe)
                    if capture.router is not None:
                        self._load_router(module, layer, capture.router)
                    if replay is not None and replay.replayable(len(hidden)):
                        with replay.replaying():
                            outputs = self._forward_routed(module, layer, hidden, capture)
                    else:
                        outputs = self._forward_routed(module, layer, hidden, capture)
                elif skipped is not None and not unused:
                    outputs = self.forward_layer(module, layer, hidden)
                result = capture.result
                capture.moe = capture.moe_input = capture.attention_received = capture.rest = None
                capture.router_input = capture.token_ids = None
                capture.replacement = capture.router = None
                del capture
            del moe, replay
            self.release(module)
            hidden = self.next_inputs(layer, outputs)
            if state is not None:
                carried = self.carry.tensors() if self.carry.active else None
                state.commit(layer, hidden, result, carried, last=layer == self.adapter.num_layers - 1)
        self.last_hidden = None if self.last_outputs_unused else hidden
        """The last decoder layer's outputs per batch (what an MTP layer takes), once the sweep has finished."""
        if hasattr(self, "_reading"):
            self._reading.shutdown(wait=True)
            del self._reading, self._prefetched
        self.reader.close()

    def _attention_replay(self, module: torch.nn.Module, layer: int) -> AttentionReplay | None:
        """A recorder of layer ``layer``'s attention outputs for its recomputing forward (:mod:`.attention_replay`);
        None where the layer has no such attention module."""
        try:
            attention = module.get_submodule(self.adapter.attention_module)
        except AttributeError:
            return None
        site = module.get_submodule(self.adapter.runtime_in_layer(layer, self.adapter.moe_site_module))
        return AttentionReplay(attention, site)

    def _looped_segment(
        self, hidden: list[torch.Tensor], state: SweepState | None
    ) -> Generator[LayerCapture, None, list[torch.Tensor]]:
        """The looped segment (:attr:`~moecompress.families.FamilyAdapter.loop_layers`) from its input ``hidden``;
        returns its output after the last pass.

        Its layers are materialised together (the stock forward runs each of them once per pass). Each MoE layer's
        capture, yielded in order once every pass has run, holds the inputs of all its passes in the stock forward's
        order (batch by batch, each batch pass by pass; each batch's tags repeated as many times). Where the consumer
        sets replacements, the passes run again with every replaced layer, each used for every pass; the captures of
        a looped layer saw the original weights of the looped layers before it (their replacements are only known
        once the passes have run)."""
        adapter, loop, passes = self.adapter, self.adapter.loop_layers, self.adapter.loop_passes
        held = {}
        for layer in loop:
            if self.keep_tensors:
                held[layer] = self._materialise(layer)
            else:
                module, moe = self.materialise(layer)
                held[layer] = (module, moe, None, None)
        self.prefetch(loop.stop)
        inputs = {layer: [] for layer in loop}
        received = {layer: [] for layer in loop}
        extras: dict[int, dict[str, Any]] = {layer: {} for layer in loop}
        handles = []
        for layer, (module, moe, _, _) in held.items():
            if moe is None:
                continue
            site = adapter.runtime_in_layer(layer, adapter.moe_site_module)
            handles.append(_capture_input(module.get_submodule(site), inputs[layer]))
            handles += adapter.attention_expert_hooks(module, extras[layer])
            if self.capture_attention and adapter.softmax_attention(layer):
                handles.append(
                    module.get_submodule(adapter.attention_module).register_forward_hook(
                        lambda mod, args, out, into=received[layer]: into.append(_attention_received(out[1]))
                    )
                )
        outputs = self._loop_passes(held, hidden)
        for handle in handles:
            handle.remove()
        batches = len(hidden)
        sizes = [states.shape[:-1].numel() for states in hidden]

        def batch_major(values: list[Any]) -> list[Any]:
            """``values`` of one call per pass and batch, pass-major as the passes ran, in the stock order."""
            return [values[step * batches + batch] for batch in range(batches) for step in range(passes)]

        def repeated(values: torch.Tensor) -> torch.Tensor:
            return torch.cat([chunk.repeat(passes) for chunk in values.split(sizes)])

        routed, replaced, results = [], False, {}
        for layer, (module, moe, rest, layout) in held.items():
            if moe is None and not self.keep_tensors:
                continue
            capture = LayerCapture(
                layer=layer,
                moe=moe,
                moe_input=torch.cat(batch_major(inputs.pop(layer))).float() if moe is not None else None,
                tags=repeated(self.tags_of(layer)),
                tag_names=self.tag_names,
                attention_received=torch.cat(batch_major(received[layer])).cpu() if received[layer] else None,
                extra=extras[layer],
                rest=rest,
                layout=layout,
                token_ids=repeated(self.token_ids) if moe is not None and moe.token_table is not None else None,
            )
            yield capture
            if capture.replacement is not None:
                replaced = True
                self._load_moe(module, layer, capture.replacement, capture.moe)
                if capture.router is not None:
                    self._load_router(module, layer, capture.router)
                if capture.allowed is not None:
                    routed += self._reroute_hooks(module, capture)
            results[layer] = capture.result
            capture.moe = capture.moe_input = capture.attention_received = capture.rest = None
            capture.token_ids = capture.replacement = capture.router = None
            del capture
        if replaced:
            outputs = self._loop_passes(held, hidden)
        for handle in routed:
            handle.remove()
        for module, *_ in held.values():
            self.release(module)
        del held
        if state is not None:
            for layer in loop[:-1]:
                state.hand_over(layer, results.get(layer))
            carried = self.carry.tensors() if self.carry.active else None
            last = loop[-1] == adapter.num_layers - 1
            state.commit(loop[-1], outputs, results.get(loop[-1]), carried, last=last)
        return outputs

    def _loop_passes(self, held: dict[int, tuple], hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        """The looped segment's output after its last pass, with the ``held`` layer modules, as the stock forward
        computes it: every pass starts from ``hidden`` (and the block stack that entered the segment); each pass after
        the first gives every looped layer the messages of the previous pass (its output and its block-boundary
        inputs past the segment's first)."""
        adapter, loop = self.adapter, self.adapter.loop_layers
        inside = [layer for layer in loop[1:] if adapter.is_block_boundary(layer)]
        message_input = self._message_input
        if is_accelerated():
            message_input = message_input.to(compute_device())
        previous: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        outputs = hidden
        try:
            for _ in range(adapter.loop_passes):
                outputs = hidden
                for index, layer in enumerate(loop):
                    with torch.inference_mode():
                        self._loop_messages = (
                            [None] * len(hidden)
                            if previous is None
                            else [message_input(stack, last, index) for stack, last in previous]
                        )
                    outputs = self.forward_layer(held[layer][0], layer, outputs)
                with torch.inference_mode():
                    previous = [
                        (
                            self.carry.stack([to_compute(self.carry.blocks[batch][layer]) for layer in inside], out),
                            to_compute(out),
                        )
                        for batch, out in enumerate(outputs)
                    ]
        finally:
            self._loop_messages = None
        return outputs

    def _skipped_experts(self, module: torch.nn.Module, layer: int) -> ViewExperts | None:
        """With ``replaces``: the layer's :class:`ViewExperts`, set to skip its experts in the capturing forward;
        None where they cannot be skipped (no view experts; a family that carries layer outputs to later layers)."""
        experts = getattr(self._experts_parent(module, layer), "experts", None)
        if not self.replaces or self.carry.active or not isinstance(experts, ViewExperts):
            return None
        experts.outputs_unused = True
        return experts

    def tags_of(self, layer: int) -> torch.Tensor:
        """The tags of layer ``layer``'s tokens: the decoder's in an encoder-decoder's decoder."""
        if self.decoder_tags is None or layer < self.adapter.stack_starts()[-1]:
            return self.tags
        return self.decoder_tags

    def injected(self, layer: int, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Layer ``layer``'s outputs per batch with what the stock forward adds to them before the next layer (the
        plans' injections)."""
        return [
            out + plan.injections[layer] if layer in plan.injections else out
            for out, plan in zip(outputs, self.plans, strict=True)
        ]

    def next_inputs(self, layer: int, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The next layer's inputs per batch from layer ``layer``'s outputs: :meth:`injected`, then at the end of a
        stack :meth:`next_stack`."""
        hidden = self.injected(layer, outputs)
        if layer + 1 in self.adapter.stack_starts():
            hidden = self.next_stack(layer, hidden)
        return hidden

    def next_stack(self, layer: int, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """At the end of an encoder-decoder's stack: its output through :attr:`encoder_output_norm` carried for the
        later layers (their cross-attention input), and the next stack's recorded first inputs."""
        with torch.inference_mode():
            for batch, out in enumerate(outputs):
                self.carry.encoder_output(batch, self.encoder_norm(out))
        return [plan.stack_inputs[layer + 1] for plan in self.plans]

    def _forward_routed(
        self, module: torch.nn.Module, layer: int, hidden: list[torch.Tensor], capture: LayerCapture
    ) -> list[torch.Tensor]:
        """The layer's outputs with its replacement loaded, routing only among ``capture.allowed`` if set (and the
        attention's experts only among ``capture.extra["attention_allowed"]`` if set)."""
        if capture.allowed is None:
            return self.forward_layer(module, layer, hidden)
        handles = self._reroute_hooks(module, capture)
        try:
            return self.forward_layer(module, layer, hidden)
        finally:
            for handle in handles:
                handle.remove()

    def _reroute_hooks(self, module: torch.nn.Module, capture: LayerCapture) -> list[Any]:
        """Hooks routing ``module`` only among ``capture.allowed`` (and its attention's experts among
        ``capture.extra["attention_allowed"]`` if set); their handles."""
        adapter, allowed = self.adapter, capture.allowed
        moe = capture.moe if capture.router is None else capture.router

        def choose(logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            return adapter.route(moe, logits, allowed.to(logits.device), token_ids)

        handles = adapter.reroute_hooks(module, choose)
        if capture.extra.get("attention_allowed") is not None:
            handles += adapter.attention_reroute_hooks(module, capture.extra["attention_allowed"])
        return handles

    def forward_layer(self, module: torch.nn.Module, layer: int, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        """The layer's outputs for each batch's input hidden states, called as the stock forward calls it."""
        outputs = []
        accelerated = is_accelerated()
        with torch.inference_mode():
            for index, states in enumerate(hidden):
                args, kwargs = self.call_arguments(layer, index)
                kwargs = self.carry.arguments(layer, index, kwargs)
                args = self.carry.positional(layer, index, to_compute(states), args)
                if self._loop_messages is not None:
                    position = self.adapter.message_argument
                    args = (*args[:position], self._loop_messages[index], *args[position + 1 :])
                out = module(to_compute(states), *args, **kwargs)
                self.carry.record(layer, index, out, kwargs, states)
                out = out[0] if isinstance(out, tuple) else out
                outputs.append(host_buffer(out) if accelerated else out)
        return outputs


def _meta_model(auto_class, config, dtype: torch.dtype, attention: str) -> torch.nn.Module:
    """The model on the meta device with ``attention``, or with eager attention for a family that lacks it
    (GPT-OSS has no SDPA path)."""

    def build(implementation: str) -> torch.nn.Module:
        config._attn_implementation = implementation
        _text_config(config)._attn_implementation = implementation
        return auto_class.from_config(config, dtype=dtype)

    try:
        return build(attention)
    except ValueError:
        if attention == "eager":
            raise
        return build("eager")


def _capture_input(module: torch.nn.Module, into: list[torch.Tensor], lengths: list[int] | None = None) -> Any:
    """A forward hook that appends ``module``'s first input, flattened to ``[T, H]``, to ``into`` (and the length of
    each of its sequences, ``[B, S, H]``, to ``lengths``); its handle."""

    def hook(mod, args, out):
        into.append(args[0].reshape(-1, args[0].shape[-1]))
        if lengths is not None:
            lengths.extend([args[0].shape[-2]] * args[0].shape[:-2].numel())

    return module.register_forward_hook(hook)


def _initialise_meta_buffers(module: torch.nn.Module, model: torch.nn.Module) -> None:
    """Buffers a checkpoint does not hold (DeepSeek-V4's attention compressors' own rotary tables, non-persistent)
    made on the host and set by the model's own initialisation, as transformers does for them at load."""
    for child in module.modules():
        if any(buffer.is_meta for buffer in child.buffers(recurse=False)):
            child.to_empty(device=HOST, recurse=False)
            model._init_weights(child)


def _convert_in_turn(moe: MoEWeights, dtype: torch.dtype) -> None:
    """Convert ``moe``'s floating-point tensors to ``dtype`` in place, one at a time, so that each old tensor is
    freed before the next is converted (the view holds the only reference)."""
    for item in fields(moe):
        value = getattr(moe, item.name)
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            setattr(moe, item.name, value.to(dtype))
            del value


def _attention_received(weights: torch.Tensor | None) -> torch.Tensor:
    """Per key token: the mean, over heads and over the queries that can see it, of the attention it gets."""
    if weights is None:
        raise RuntimeError("attention weights were not returned; eager attention is required")
    total = weights.float().sum(dim=(1, 2)) / weights.shape[1]
    seen_by = (weights.float().sum(dim=1) > 0).sum(dim=1).clamp_min(1)
    return (total / seen_by).reshape(-1)


class UpcastingHead(torch.nn.Module):
    """An output projection kept in the checkpoint's 16-bit dtype and computed in its input's dtype a block of
    vocabulary rows at a time: at Qwen3-30B-A3B's 151,936 tokens a float32 copy of the head is 1.2 GB, and an
    evaluation holds two. Each logit is the same dot product as with the float32 head (bf16 to float32 is
    exact)."""

    ROWS = 16384

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        blocks = []
        for start in range(0, self.weight.shape[0], self.ROWS):
            bias = None if self.bias is None else self.bias[start : start + self.ROWS].to(hidden.dtype)
            blocks.append(F.linear(hidden, self.weight[start : start + self.ROWS].to(hidden.dtype), bias))
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)


def _untied_head_key(skeleton: torch.nn.Module) -> str | None:
    """The parameter name of the output projection's weight, None when it is the input embeddings' (tied)."""
    head, embeddings = skeleton.get_output_embeddings(), skeleton.get_input_embeddings()
    if head is None or getattr(head, "weight", None) is None or head.weight is embeddings.weight:
        return None
    return next((name for name, param in skeleton.named_parameters() if param is head.weight), None)


def _fill_missing_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters not loaded (the skeleton's are created on the meta device and the stored ones assigned, so no
    float32 copy is allocated and then overwritten) become zeros that take no memory (one element, expanded):
    the input embeddings :meth:`CalibrationSweep.text_head_logits` leaves out, which its forward never reads."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                setattr(module, name, _placeholder(param.shape, dtype, HOST))


def _move(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to(device)``, with the placeholders of :func:`_fill_missing_parameters` made again on ``device``
    rather than copied (a copy would take their full size there)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() and param.numel() and not any(param.stride()) and param.device != device:
                setattr(module, name, _placeholder(param.shape, param.dtype, device))
    model.to(device)


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Parameter:
    """A frozen parameter of ``shape`` that reads as zeros and holds one element (expanded, all strides 0)."""
    return torch.nn.Parameter(torch.zeros((), dtype=dtype, device=device).expand(shape), requires_grad=False)


def split_windows(
    batches: list[dict[str, torch.Tensor]], hidden: list[torch.Tensor], windows: int
) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """Text-only ``batches`` and their hidden states cut into batches of at most ``windows`` windows (rows), for a
    head whose logits would not fit for a whole batch at a large vocabulary."""
    out_batches, out_hidden = [], []
    for batch, states in zip(batches, hidden, strict=True):
        for start in range(0, states.shape[0], windows):
            out_batches.append({key: value[start : start + windows] for key, value in batch.items()})
            out_hidden.append(states[start : start + windows])
    return out_batches, out_hidden
