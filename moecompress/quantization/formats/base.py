"""What an output format is: an :class:`OutputFormat` subclass registered under the name the quantize pass's
``format`` option takes, holding every decision that depends on the format (what it can hold, how a layer's
tensors are laid out, the ``quantization_config`` it writes, how its stored tensors count as weights). Nothing
outside the format modules compares a format's name.

Adding a format is one module with a :func:`register`-decorated subclass and one import line in
:mod:`moecompress.quantization.formats`; a format defined elsewhere (a test, a user's script) registers the same
way before it is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ...registry import RegisteredNames, Registry

if TYPE_CHECKING:
    from ...checkpoint.reader import TensorInfo
    from ...families import FamilyAdapter
    from ..experts import QuantizedMoE
    from ..scheme import QuantizedTensor, QuantScheme

OUTPUT_FORMATS: Registry[OutputFormat] = Registry("format")


class OutputFormat:
    """The behaviour of one output format. Subclasses set :attr:`name` and :attr:`quant_method` and write the
    three layout methods."""

    name: ClassVar[str]
    quant_method: ClassVar[str | None] = None
    """``quantization_config.quant_method`` of a checkpoint in this format (how a written one is recognised)."""
    holds_salient: ClassVar[bool] = False
    """Whether salient (sparse bf16) weights have a place in it."""
    holds_adapters: ClassVar[bool] = False
    """Whether low-rank error adapters have a place in it."""
    needs_plugin: ClassVar[bool] = False
    """Whether stock transformers loads it only after ``import moecompress`` (the plugin registers it)."""
    card_tag: ClassVar[str | None] = None
    """A Hub tag for a model card of an output in this format."""
    card_note: ClassVar[str | None] = None
    """A model card's sentence on what loading this format needs."""

    def unsupported(self, adapter: FamilyAdapter, scheme: QuantScheme, targets: tuple[str, ...]) -> str | None:
        """Why this format cannot hold the request (one line, naming options with ``named``), or None."""
        return None

    def layer_tensors(
        self,
        adapter: FamilyAdapter,
        layer: int,
        moe: QuantizedMoE | None,
        rest: dict[str, torch.Tensor | QuantizedTensor],
    ) -> dict[str, torch.Tensor]:
        """Decoder layer ``layer``'s tensors as written: its quantised experts ``moe`` (None for a layer without
        routed experts) and the rest under their on-disk keys."""
        raise NotImplementedError

    def outside_tensors(
        self, adapter: FamilyAdapter, tensors: dict[str, torch.Tensor | QuantizedTensor]
    ) -> dict[str, torch.Tensor]:
        """The tensors outside the decoder layers (``lm_head`` among them) as written."""
        raise NotImplementedError

    def config_for(
        self,
        adapter: FamilyAdapter,
        scheme: QuantScheme,
        expert_modules: list[str],
        weight_keys: list[str],
        lowrank: dict[str, dict[str, list[int]]] | None = None,
        salient: dict[str, dict[str, list[int]]] | None = None,
    ) -> dict[str, Any]:
        """``config.json``'s ``quantization_config``."""
        raise NotImplementedError

    def logical_weights(
        self, key: str, info: TensorInfo, quantization: dict[str, Any], scales: TensorInfo | None
    ) -> int | None:
        """Logical weights the stored tensor ``key`` holds, 0 for pure metadata, None for a plain float tensor (the
        footprint's count; ``scales``: the tensor's ``_scales`` entry, if any)."""
        return None

    def is_adapter(self, key: str) -> bool:
        """Whether ``key`` is a low-rank adapter tensor (bytes of its class, no logical weights)."""
        return False


register = OUTPUT_FORMATS.register
unregister = OUTPUT_FORMATS.unregister
format_of = OUTPUT_FORMATS.lookup


def written_format(quantization: dict[str, Any]) -> OutputFormat | None:
    """The format whose ``quant_method`` a ``quantization_config`` names, or None."""
    method = quantization.get("quant_method")
    return next((fmt for fmt in OUTPUT_FORMATS.values() if method and fmt.quant_method == method), None)


FORMATS: Sequence[str] = RegisteredNames(OUTPUT_FORMATS)
