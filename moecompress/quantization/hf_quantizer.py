"""The transformers side of the native format: ``quantization_config.quant_method = "moecompress"``.

After ``import moecompress``, ``AutoModelForCausalLM.from_pretrained(DIR)`` builds the stock model on the meta
device, and :class:`MoecompressHfQuantizer` swaps every module named in the config for its quantised twin
(:mod:`.modules`) before the weights are read, so the packed tensors load straight into place. ``save_pretrained``
writes the same tensors back under the same names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .modules import QuantizedExperts, QuantizedLinear, SalientSizes, _QuantizedWeights
from .scheme import QuantScheme

QUANT_METHOD = "moecompress"
_PROBE_PARAMETER = "weight"
"""The parameter name a module's name is renamed with (transformers' rules rename tensor names, not modules')."""
FORMAT_VERSION = 1


class MoecompressConfig(QuantizationConfigMixin):
    """``schemes`` maps a scheme key to a :class:`QuantScheme` dict; ``modules`` maps each quantised module's
    runtime name (``model.layers.3.mlp.experts``) to its scheme key; ``lowrank`` maps an experts module to the
    rank of each expert's gate/up/down error adapter (``{"gate": [r_0, r_1, ...], ...}``); ``salient`` maps a
    module to, per weight with salient weights, ``[bitmap bytes, salient weights]`` (the stored tensors' sizes,
    which the module needs before the weights are read)."""

    def __init__(
        self,
        schemes: dict[str, dict[str, Any]] | None = None,
        modules: dict[str, str] | None = None,
        lowrank: dict[str, dict[str, list[int]]] | None = None,
        salient: dict[str, dict[str, list[int]]] | None = None,
        format_version: int = FORMAT_VERSION,
        **kwargs: Any,
    ):
        self.quant_method = QUANT_METHOD
        self.schemes = dict(schemes or {})
        self.modules = dict(modules or {})
        self.lowrank = dict(lowrank or {})
        self.salient = dict(salient or {})
        self.format_version = int(format_version)
        if self.format_version > FORMAT_VERSION:
            raise ValueError(
                f"this checkpoint uses moecompress format {self.format_version}; "
                f"this moecompress reads up to {FORMAT_VERSION}: upgrade moecompress"
            )
        missing = sorted(set(self.modules.values()) - set(self.schemes))
        if missing:
            raise ValueError(f"moecompress quantization_config names undefined schemes {missing}")

    def scheme_of(self, module_name: str) -> QuantScheme:
        return QuantScheme.from_dict(self.schemes[self.modules[module_name]])

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": self.quant_method,
            "format_version": self.format_version,
            "schemes": self.schemes,
            "modules": self.modules,
            **({"lowrank": self.lowrank} if self.lowrank else {}),
            **({"salient": self.salient} if self.salient else {}),
        }

    def salient_of(self, module_name: str) -> SalientSizes | None:
        sizes = self.salient.get(module_name)
        if sizes is None:
            return None
        try:
            return {param: (int(nbytes), int(count)) for param, (nbytes, count) in sizes.items()}
        except (TypeError, ValueError):
            raise ValueError(f"moecompress quantization_config: bad salient sizes for {module_name}") from None


def _quantized_twin(
    module: torch.nn.Module,
    scheme: QuantScheme,
    activation,
    hidden: int,
    ranks: dict[str, list[int]] | None,
    salient: SalientSizes | None,
    output_norm: str | None = None,
    *,
    stock_weights: Callable[[torch.nn.Module], tuple[Any, Any, bool]],
    one_hot_dispatch: bool = False,
) -> torch.nn.Module:
    if isinstance(module, torch.nn.Linear):
        problem = scheme.width_problem(module.in_features)
        if problem:
            raise ValueError(problem)
        _check_salient_sizes({"weight": module.in_features * module.out_features}, salient)
        dtype = module.weight.dtype
        return QuantizedLinear(
            module.in_features, module.out_features, module.bias is not None, scheme, dtype, salient=salient
        )
    gate_up, down, gated = stock_weights(module)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.ndim != 3:
        raise ValueError(f"moecompress cannot quantise a {type(module).__name__} module")
    experts = down.shape[0]
    intermediate = gate_up.numel() // ((2 if gated else 1) * experts * hidden)
    _check_experts_sizes(scheme, experts, hidden, intermediate, ranks, salient, gated)
    return QuantizedExperts(
        experts,
        hidden,
        intermediate,
        scheme,
        activation,
        has_bias=getattr(module, "gate_up_proj_bias", None) is not None,
        dtype=down.dtype,
        ranks=ranks,
        salient=salient,
        gated=gated,
        output_norm=getattr(module, output_norm) if output_norm else None,
        one_hot_dispatch=one_hot_dispatch,
    )


def _check_experts_sizes(
    scheme: QuantScheme,
    experts: int,
    hidden: int,
    intermediate: int,
    ranks: dict[str, list[int]] | None,
    salient: SalientSizes | None,
    gated: bool = True,
) -> None:
    """Refuse sizes in the config that the tensors cannot have, before anything is allocated from them (a hostile
    config could otherwise ask for any amount of memory)."""
    for cols in (hidden, intermediate):
        problem = scheme.width_problem(cols)
        if problem:
            raise ValueError(problem)
    limit = min(hidden, intermediate)
    for which, per_expert in (ranks or {}).items():
        if which not in ("gate", "up", "down") or not isinstance(per_expert, list) or len(per_expert) != experts:
            raise ValueError(f"lowrank[{which!r}] must list one rank per expert ({experts})")
        if which == "gate" and not gated and any(per_expert):
            raise ValueError("lowrank['gate'] ranks must be 0: these experts have no gate projection")
        if any(not isinstance(rank, int) or not 0 <= rank <= limit for rank in per_expert):
            raise ValueError(f"lowrank[{which!r}] ranks must be integers from 0 to {limit}")
    in_name, in_rows = ("gate_up_proj", 2 * intermediate) if gated else ("up_proj", intermediate)
    _check_salient_sizes({in_name: experts * in_rows * hidden, "down_proj": experts * hidden * intermediate}, salient)


def _check_salient_sizes(numel: dict[str, int], salient: SalientSizes | None) -> None:
    for param, (nbytes, count) in (salient or {}).items():
        if param not in numel:
            raise ValueError(f"salient sizes name {param!r}, which this module does not have")
        if not 0 <= count <= numel[param] or not 0 <= nbytes <= numel[param] // 4 + 4096:
            raise ValueError(f"salient sizes of {param} ({nbytes} bytes, {count} weights) exceed the weight")


def check_all_loaded(model: torch.nn.Module) -> None:
    """Every tensor a quantised module registered must have come from the checkpoint: transformers would
    otherwise initialise it at random and only warn."""
    for name, module in model.named_modules():
        if isinstance(module, _QuantizedWeights):
            for param_name, param in module.named_parameters():
                if not getattr(param, "_is_hf_initialized", False):
                    raise ValueError(f"{name}.{param_name} is missing from the checkpoint")


def loaded_module_names(model, names: list[str]) -> dict[str, str]:
    """Each on-disk module name's name in ``model``, renamed as transformers renames that module's tensors at load:
    the conversion mapping of the class being built, then its base-model prefix added or dropped. The same
    checkpoint then loads into the vision-language class (``model.language_model.layers``) and into the text-only
    class ``AutoModelForCausalLM`` builds from it (``model.layers``)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [
        rule for rule in get_model_conversion_mapping(model, add_legacy=False) if isinstance(rule, WeightRenaming)
    ]
    leaf = "." + _PROBE_PARAMETER
    modules = {name + leaf: module for name, module in model.named_modules()}
    loaded = {}
    for name in names:
        renamed, _ = rename_source_key(name + leaf, renamings, [], model.base_model_prefix, modules)
        loaded[name] = renamed.removesuffix(leaf) if renamed in modules else name
    return loaded


def replace_quantized_modules(
    model: torch.nn.Module, config: MoecompressConfig, names: dict[str, str] | None = None, adapter=None
) -> None:
    """Swap each module named in ``config.modules`` for its quantised twin (on the module's device).

    ``names`` maps a module's name inside ``model`` to its name in ``config.modules``, for a part of the model
    (one decoder layer, which streamed evaluation builds alone); ``adapter`` then gives the model's family.
    Modules of MTP layers the config declares are skipped (transformers builds no MTP module; its tensors are
    left unused, as for an unquantised checkpoint); any other module the model lacks is refused."""
    from ..checkpoint.mtp import is_mtp_module
    from ..families import adapter_for

    adapter = adapter or adapter_for(model.config.to_dict())
    adapter.with_experts_module(model)
    hidden = adapter.experts_width
    if names is None:
        on_disk = [name for name in config.modules if not is_mtp_module(adapter, name)]
        names = {runtime: name for name, runtime in loaded_module_names(model, on_disk).items()}
    for name, full_name in names.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"the checkpoint's quantization_config names {name!r}, which this model lacks") from None
        parent_name, _, child = name.rpartition(".")
        device = next(module.parameters()).device
        with torch.device(device):
            try:
                twin = _quantized_twin(
                    module,
                    config.scheme_of(full_name),
                    adapter.activation_of(adapter.layer_of_key(full_name)),
                    hidden,
                    config.lowrank.get(full_name),
                    config.salient_of(full_name),
                    adapter.expert_output_norm,
                    stock_weights=adapter.stock_experts_weights,
                    one_hot_dispatch=adapter.experts_one_hot_dispatch,
                )
            except (ValueError, TypeError, KeyError) as error:
                raise ValueError(f"quantization_config for {full_name}: {error}") from None
        setattr(model.get_submodule(parent_name) if parent_name else model, child, twin)


def decode_salient_bitmaps(model: torch.nn.Module) -> None:
    """Decode each quantised module's salient bitmaps, one module at a time."""
    for name, module in model.named_modules():
        if isinstance(module, _QuantizedWeights):
            try:
                module.decode_salient()
            except ValueError as error:
                raise ValueError(f"{name}.{error}") from None


class MoecompressHfQuantizer(HfQuantizer):
    """Loads moecompress-quantised checkpoints (it never quantises a float model itself: use the CLI)."""

    requires_calibration = True

    def __init__(self, quantization_config: MoecompressConfig, **kwargs: Any):
        super().__init__(quantization_config, **kwargs)

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _process_model_before_weight_loading(self, model, **kwargs: Any):
        replace_quantized_modules(model, self.quantization_config)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs: Any):
        check_all_loaded(model)
        decode_salient_bitmaps(model)
        return model

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    """Make transformers resolve ``quant_method: "moecompress"`` (idempotent)."""
    AUTO_QUANTIZATION_CONFIG_MAPPING.setdefault(QUANT_METHOD, MoecompressConfig)
    AUTO_QUANTIZER_MAPPING.setdefault(QUANT_METHOD, MoecompressHfQuantizer)
