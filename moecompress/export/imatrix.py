"""``--imatrix-out``: what the quantisation pass's calibration measured, written as a llama.cpp importance matrix.

The file is the GGUF form ``llama-imatrix`` writes (``tools/imatrix/imatrix.cpp``) and ``llama-quantize --imatrix``
reads (``common/imatrix-loader.cpp``): per tensor ``<name>.in_sum2`` (F32, ``[experts, width]`` as numpy holds it:
the sum over tokens of each input channel's square, one row per expert; ``[width]`` for a dense tensor) and
``<name>.counts`` (F32, ``[experts, 1]`` or ``[1]``: the tokens summed), ``general.type = imatrix``,
``imatrix.datasets``, ``imatrix.chunk_count`` and ``imatrix.chunk_size``. For the routed experts (``mul_mat_id``)
a token counts once for each expert it is routed to, as ``llama-imatrix`` counts it, and ``ffn_down_exps`` sees
the expert's intermediate activation ``act(gate x) * up x``. Sums are accumulated in float64 and stored in float32.

Each layer's statistics are saved in the run's state directory as the layer is rewritten (a resumed run keeps
those of the layers it does not redo) and the file is assembled from them, one tensor at a time, once every layer
is written.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

from ..device import moe_on
from ..errors import OptionError, UserInputError
from ..families import FamilyAdapter, MoEWeights
from ..files import DiskFullError, is_full, write_safetensors
from ..vocabulary import named

SHARED_EXPERT = {"qwen3_moe": False, "qwen2_moe": True, "olmoe": False, "mixtral": False}
"""The families whose llama.cpp converter names the routed experts ``blk.N.ffn_{gate,up,down}_exps`` (stacked in
the checkpoint's expert order, decoder layer N as ``blk.N``) and whose router and experts read the same input;
True where the layer also has a shared expert (``ffn_{gate,up}_shexp``, reading that input too)."""

COVERED = "ffn_gate_inp, ffn_gate_exps, ffn_up_exps, ffn_down_exps"


def covered_tensors(family: str) -> list[str]:
    """The tensors of each MoE layer the file covers (``blk.N.`` and ``.weight`` left out)."""
    shared = ["ffn_gate_shexp", "ffn_up_shexp"] if SHARED_EXPERT.get(family) else []
    return [*COVERED.split(", "), *shared]


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
    from ..preflight import check_file_target, check_not_in_inputs

    label = named("imatrix_out", path)
    if out_dir is not None:
        check_outside_output(path, out_dir, owner)
    if adapter.family not in SHARED_EXPERT:
        raise OptionError(
            f"{label}: llama.cpp importance matrices are written for {', '.join(sorted(SHARED_EXPERT))}, not "
            f"{adapter.family}",
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
) -> dict[str, torch.Tensor]:
    """One MoE layer's entries, ``{name}.in_sum2`` (float64 ``[experts, width]``, ``[width]`` for a dense
    tensor) and ``{name}.counts`` (float64 ``[experts]``, ``[1]``), from the block's calibration inputs ``hidden``
    ``[T, H]`` and its weights as given (before quantisation: the activations llama.cpp computes from the model it
    quantises)."""
    from ..quantization.experts import routed_inputs

    hidden = hidden.float()
    moe = moe_on(moe, hidden.device)
    inputs = routed_inputs(adapter, moe, hidden, None if router_input is None else router_input.to(hidden.device))
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
        down[expert] = _square_sums(adapter.expert_hidden(projected, inter))
    every = _square_sums(hidden)
    tokens = torch.tensor([float(hidden.shape[0])], dtype=torch.float64)
    entries = {"ffn_gate_inp": (every, tokens), "ffn_gate_exps": (routed, counts), "ffn_up_exps": (routed, counts)}
    entries["ffn_down_exps"] = (down, counts)
    if SHARED_EXPERT.get(adapter.family):
        entries["ffn_gate_shexp"] = entries["ffn_up_shexp"] = (every, tokens)
    out = {}
    for tensor, (sums, count) in entries.items():
        name = f"blk.{layer}.{tensor}.weight"
        out[f"{name}.in_sum2"], out[f"{name}.counts"] = sums, count
    return out


class ImatrixCollector:
    """Saves each MoE layer's entries in ``directory`` as the layer is rewritten, and writes the file at the end."""

    def __init__(self, directory: Path, adapter: FamilyAdapter):
        self.directory, self.adapter = Path(directory), adapter
        self.layers: set[int] = set()
        self.directory.mkdir(parents=True, exist_ok=True)

    def _file(self, layer: int) -> Path:
        return self.directory / f"layer-{layer}.safetensors"

    def add(self, layer: int, moe: MoEWeights, hidden: torch.Tensor, router_input: torch.Tensor | None) -> None:
        entries = layer_statistics(self.adapter, layer, moe, hidden, router_input)
        write_safetensors(self._file(layer), {k: v.contiguous() for k, v in entries.items()}, {})
        self.layers.add(layer)

    def restore(self, layer: int) -> None:
        """A layer a killed run wrote: its entries were saved with it."""
        if not self._file(layer).is_file():
            raise RuntimeError(f"importance matrix of layer {layer} missing from {self.directory}")
        self.layers.add(layer)

    def write(self, path: Path, datasets: list[str], chunk_count: int, chunk_size: int) -> int:
        """The importance matrix at ``path`` (replaced in one step); returns the number of tensors it covers."""
        located: dict[str, Path] = {}
        for layer in sorted(self.layers):
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
