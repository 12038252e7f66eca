"""``--imatrix-out``: what the quantisation pass's calibration measured, written as a llama.cpp importance matrix.

The file is the GGUF form ``llama-imatrix`` writes (``tools/imatrix/imatrix.cpp``) and ``llama-quantize --imatrix``
reads (``common/imatrix-loader.cpp``): per tensor ``<name>.in_sum2`` (F32, ``[experts, width]`` as numpy holds it:
the sum over tokens of each input channel's square, one row per expert; ``[width]`` for a dense tensor) and
``<name>.counts`` (F32, ``[experts, 1]`` or ``[1]``: the tokens summed), ``general.type = imatrix``,
``imatrix.datasets``, ``imatrix.chunk_count`` and ``imatrix.chunk_size``. For the routed experts (``mul_mat_id``)
a token counts once for each expert it is routed to, as ``llama-imatrix`` counts it, and ``ffn_down_exps`` sees
the expert's intermediate activation ``act(gate x) * up x``. Sums are accumulated in float64 and stored in float32.

It covers every matrix ``llama-quantize`` quantises with an importance matrix, under the names llama.cpp's
converter gives them: attention (``attn_q/k/v`` read the normed hidden state, ``attn_output`` the attention's output
before ``o_proj``), the router and routed experts, the shared expert (``ffn_{gate,up,down}_shexp`` and its gate
``ffn_gate_inp_shexp``), a dense layer's
MLP (``ffn_{gate,up,down}``) and an untied output head (``output``: the final norm of the last layer's output;
a tied head is the token embedding, which ``llama-imatrix`` does not collect either). The routed experts' sums come
from the block's calibration inputs; the others from forward pre-hooks on the stock modules of the calibration
sweep's model (:meth:`ImatrixCollector.attach`), in the same forward, counting each layer's first forward only.

Each layer's statistics are saved in the run's state directory as the layer is calibrated or rewritten (a resumed
run keeps those of the layers it does not redo) and the file is assembled from them, one tensor at a time, once
every layer is written.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

from ..device import moe_on
from ..errors import OptionError, UserInputError
from ..families import FamilyAdapter, MoEWeights, families_declaring
from ..files import DiskFullError, is_full, write_safetensors
from ..vocabulary import named

ROUTED = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
ATTENTION = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
"""llama.cpp's names of the attention matrices, and their modules under the family's attention module."""
SHARED = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
DENSE = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
"""A dense decoder layer's MLP (Qwen2-MoE's and Qwen3-MoE's ``mlp_only_layers``)."""
HEAD = "output.weight"


def covered_tensors(adapter: FamilyAdapter) -> list[str]:
    """The tensors of each MoE layer the file covers (``blk.N.`` and ``.weight`` left out; which families have a
    llama.cpp naming, and a shared expert in it: ``FamilyAdapter.llama_cpp_shared_expert``)."""
    shared = list(SHARED) if adapter.llama_cpp_naming() else []
    return [*ATTENTION, *ROUTED, *shared]


def dense_tensors() -> list[str]:
    """The tensors of each dense layer the file covers."""
    return [*ATTENTION, *DENSE]


def hooked_modules(adapter: FamilyAdapter, moe_layer: bool) -> dict[str, str]:
    """llama.cpp's name of each matrix of a decoder layer whose input a forward pre-hook sums, and its module."""
    modules = {name: f"{adapter.attention_module}.{module}" for name, module in ATTENTION.items()}
    if not moe_layer:
        return {**modules, **DENSE}
    return {**modules, **SHARED} if adapter.llama_cpp_naming() else modules


def check_outside_output(path: Path, out_dir: Path, owner: type) -> None:
    """The file is not inside the output directory, which the run replaces as a whole at its end."""
    real, out = Path(path).expanduser().resolve(), Path(out_dir).expanduser().resolve()
    if out == real or out in real.parents:
        raise OptionError(
            f"{named('imatrix_out', path)}: inside the output directory {out_dir}, which the run replaces at its "
            "end; name a file outside it",
            owner,
        )


def check_imatrix_target(
    path: Path, adapter: FamilyAdapter, inputs: list[Path], owner: type, out_dir: Path | None = None
) -> None:
    """Refused before any work (naming ``imatrix_out`` of ``owner``, a config class): a family without a known
    llama.cpp naming, a target that cannot be written, or one inside an input or the output."""
    from ..runner.preflight import check_file_target, check_not_in_inputs

    label = named("imatrix_out", path)
    if out_dir is not None:
        check_outside_output(path, out_dir, owner)
    if adapter.llama_cpp_naming() is None:
        named_families = ", ".join(families_declaring("llama_cpp_shared_expert"))
        raise OptionError(
            f"{label}: llama.cpp importance matrices are written for {named_families}, not {adapter.family}",
            owner,
        )
    try:
        check_file_target(Path(path), label)
        check_not_in_inputs(Path(path), list(inputs), label)
    except OptionError:
        raise
    except UserInputError as error:
        raise OptionError(str(error), owner) from None


def _square_sums(rows: torch.Tensor) -> torch.Tensor:
    return rows.double().pow(2).sum(dim=0).cpu()


def layer_statistics(
    adapter: FamilyAdapter,
    layer: int,
    moe: MoEWeights,
    hidden: torch.Tensor,
    router_input: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    sequence_lengths: list[int] | None = None,
) -> dict[str, torch.Tensor]:
    """One MoE layer's entries, ``{name}.in_sum2`` (float64 ``[experts, width]``, ``[width]`` for a dense
    tensor) and ``{name}.counts`` (float64 ``[experts]``, ``[1]``), from the block's calibration inputs ``hidden``
    ``[T, H]`` and its weights as given (before quantisation: the activations llama.cpp computes from the model it
    quantises; a family that routes whole sequences, by ``hidden``'s ``sequence_lengths``)."""
    from ..quantization.experts import routed_inputs

    hidden = hidden.float()
    moe = moe_on(moe, hidden.device)
    router_input = None if router_input is None else router_input.to(hidden.device)
    inputs = routed_inputs(adapter, moe, hidden, router_input, token_ids, sequence_lengths)
    width, inter = moe.gate_up.shape[-1], moe.intermediate_size
    routed = torch.zeros(moe.num_experts, width, dtype=torch.float64)
    down = torch.zeros(moe.num_experts, moe.down.shape[-1], dtype=torch.float64)
    counts = torch.zeros(moe.num_experts, dtype=torch.float64)
    for expert, x in enumerate(inputs):
        if not x.shape[0]:
            continue
        counts[expert] = x.shape[0]
        routed[expert] = _square_sums(x)
        projected = F.linear(x, moe.gate_up[expert].float())
        if moe.gate_up_bias is not None:
            projected = projected + moe.gate_up_bias[expert].float()
        down[expert] = _square_sums(adapter.expert_hidden(projected, inter, moe.layer))
    every = _square_sums(hidden)
    tokens = torch.tensor([float(hidden.shape[0])], dtype=torch.float64)
    entries = {"ffn_gate_inp": (every, tokens), "ffn_gate_exps": (routed, counts), "ffn_up_exps": (routed, counts)}
    entries["ffn_down_exps"] = (down, counts)
    out = {}
    for tensor, (sums, count) in entries.items():
        name = f"blk.{layer}.{tensor}.weight"
        out[f"{name}.in_sum2"], out[f"{name}.counts"] = sums, count
    return out


class ImatrixCollector:
    """Saves each layer's entries in ``directory`` as the layer is calibrated (a dense layer) or rewritten (a MoE
    layer), and writes the file at the end."""

    def __init__(self, directory: Path, adapter: FamilyAdapter):
        self.directory, self.adapter = Path(directory), adapter
        self.directory.mkdir(parents=True, exist_ok=True)
        self._handles: list[Any] = []
        self._sums: dict[int, dict[str, tuple[torch.Tensor, int]]] = {}
        self._calls: dict[int, int] = {}
        self._hooked: dict[int, dict[str, torch.Tensor]] = {}
        self._finished: set[int] = set()
        self._attached = False
        self._drain = None

    def _file(self, layer: int) -> Path:
        return self.directory / f"layer-{layer}.safetensors"

    @property
    def layers(self) -> list[int]:
        """The layers whose entries are saved."""
        return sorted(int(path.stem.removeprefix("layer-")) for path in self.directory.glob("layer-*.safetensors"))

    def attach(self, sweep: Any, drain=None) -> None:
        """Hook the stock modules of ``sweep``'s decoder layers (a :class:`~moecompress.sweep.engine.CalibrationSweep`
        about to run): the inputs of attention, shared-expert and dense-MLP matrices, and, on the last layer, the
        output head's input. A layer's sums are complete after its forward of every batch; later forwards (the
        sweep runs a layer again with its quantised experts) are not counted. ``drain``, if given, is called
        before the file is written, to let the sweep run the layers after the last MoE layer."""
        from ..sweep.mtp import _final_norm_path, _norm

        adapter = sweep.adapter
        batches, last = len(sweep.plans), adapter.num_layers - 1
        moe_layers = set(adapter.moe_layers())
        keys = set(sweep.reader.keys())
        head = None
        if "lm_head.weight" in keys and not adapter.text_config.get("tie_word_embeddings", False):
            head = _norm(sweep, sweep.reader.tensor(f"{_final_norm_path(adapter)}.weight"))
        modules = adapter.decoder_layers(sweep._meta_model)
        for layer in range(adapter.num_layers):
            module = modules[layer]
            for name, path in hooked_modules(adapter, layer in moe_layers).items():
                hook = partial(self._input, layer, f"blk.{layer}.{name}.weight")
                self._handles.append(module.get_submodule(path).register_forward_pre_hook(hook))
            done = partial(self._layer_done, layer, batches, layer in moe_layers, head if layer == last else None)
            self._handles.append(module.register_forward_hook(done))
        self._attached, self._drain = True, drain

    def _add_sums(self, layer: int, name: str, rows: torch.Tensor) -> None:
        rows = rows.reshape(-1, rows.shape[-1])
        sums, count = self._sums.setdefault(layer, {}).get(name, (0, 0))
        self._sums[layer][name] = (sums + rows.float().pow(2).sum(dim=0, dtype=torch.float64), count + rows.shape[0])

    def _input(self, layer: int, name: str, module: torch.nn.Module, args: tuple) -> None:
        if layer not in self._finished:
            self._add_sums(layer, name, args[0])

    def _layer_done(
        self, layer: int, batches: int, moe: bool, head: torch.nn.Module | None, module, args, output
    ) -> None:
        if layer in self._finished:
            return
        if head is not None:
            states = output[0] if isinstance(output, tuple) else output
            self._add_sums(layer, HEAD, head.to(states.device)(states))
        self._calls[layer] = self._calls.get(layer, 0) + 1
        if self._calls[layer] < batches:
            return
        self._finished.add(layer)
        entries = {}
        for name, (sums, count) in self._sums.pop(layer, {}).items():
            entries[f"{name}.in_sum2"] = sums.cpu()
            entries[f"{name}.counts"] = torch.tensor([float(count)], dtype=torch.float64)
        if moe:
            self._hooked[layer] = entries
        else:
            self._save(layer, entries)

    def _save(self, layer: int, entries: dict[str, torch.Tensor]) -> None:
        write_safetensors(self._file(layer), {k: v.contiguous() for k, v in entries.items()}, {})

    def add(
        self,
        layer: int,
        moe: MoEWeights,
        hidden: torch.Tensor,
        router_input: torch.Tensor | None,
        token_ids: torch.Tensor | None = None,
        sequence_lengths: list[int] | None = None,
    ) -> None:
        """A MoE layer's routed entries, saved with what the hooks summed of it."""
        entries = layer_statistics(self.adapter, layer, moe, hidden, router_input, token_ids, sequence_lengths)
        self._save(layer, {**entries, **self._hooked.pop(layer, {})})

    def restore(self, layer: int) -> None:
        """A layer a killed run wrote: its entries were saved with it."""
        if not self._file(layer).is_file():
            raise RuntimeError(f"importance matrix of layer {layer} missing from {self.directory}")

    def has(self, name: str) -> bool:
        """Whether a saved layer holds the entries of tensor ``name`` (``output.weight``: the last layer's)."""
        layers = self.layers
        if not layers:
            return False
        with safe_open(self._file(layers[-1]), "pt") as handle:
            return f"{name}.in_sum2" in handle.keys()

    def finish(self) -> None:
        """Every layer calibrated (the sweep drained, once every MoE layer is written) and the hooks removed."""
        drain, self._drain = self._drain, None
        if drain is not None:
            drain()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def write(self, path: Path, datasets: list[str], chunk_count: int, chunk_size: int) -> int:
        """The importance matrix at ``path`` (replaced in one step); returns the number of tensors it covers."""
        self.finish()
        missing = sorted(set(range(self.adapter.num_layers)) - set(self.layers))
        if self._attached and missing:
            raise RuntimeError(f"importance matrix of layers {missing} missing from {self.directory}")
        located: dict[str, Path] = {}
        for layer in self.layers:
            with safe_open(self._file(layer), "pt") as handle:
                located.update({key: self._file(layer) for key in handle.keys()})
        bases = sorted({key.rsplit(".", 1)[0] for key in located})
        names = [f"{base}.{part}" for base in bases for part in ("in_sum2", "counts")]  # llama-imatrix's order
        path = Path(path)
        temporary = path.with_name(f".{path.name}.tmp")
        writer = gguf.GGUFWriter(temporary, arch="")
        writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)  # llama-imatrix writes none
        writer.add_type(gguf.GGUFType.IMATRIX)
        writer.add_array(gguf.Keys.IMatrix.DATASETS, datasets)
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, chunk_count)
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, chunk_size)
        shapes = {}
        for key in names:
            with safe_open(located[key], "pt") as handle:
                shape = tuple(handle.get_slice(key).get_shape())
            routed = key.endswith(".counts") and len(shapes[key.removesuffix("counts") + "in_sum2"]) == 2
            shapes[key] = (shape[0], 1) if routed else shape
            writer.add_tensor_info(key, shapes[key], np.dtype(np.float32), 4 * int(np.prod(shapes[key])))
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for key in names:
                with safe_open(located[key], "pt") as handle:
                    values = handle.get_tensor(key).float().numpy().reshape(shapes[key])
                writer.write_tensor_data(values)
            writer.close()
            os.replace(temporary, path)
        except OSError as error:
            writer.close()
            temporary.unlink(missing_ok=True)
            if is_full(error):
                raise DiskFullError(str(path), error.errno, None) from error
            raise
        except BaseException:
            writer.close()
            temporary.unlink(missing_ok=True)
            raise
        return len(names) // 2
