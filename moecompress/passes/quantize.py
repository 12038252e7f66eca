"""The quantisation pass: stream a checkpoint layer by layer, quantise the targeted weights (RTN, or GPTQ on
routed calibration inputs for the expert matrices), write the chosen format, account for every byte.

Targets: ``experts`` (routed experts, always the point), ``shared_experts``, ``attention`` (every 2-D attention
projection), ``lm_head``. Routers, norms, embeddings and biases always stay in their original precision.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.decode import native_refusal
from ..checkpoint.mtp import MTP_MODES
from ..checkpoint.stream import OUTSIDE_UNIT, layer_unit
from ..defaults import DEFAULT_CALIB_TOKENS, DEFAULT_DATA, DEFAULT_EVAL_TOKENS, DEFAULT_IMAGE_SIZE, DEFAULT_SEQ_LEN
from ..errors import OptionError, UserInputError
from ..export.imatrix import HEAD, ImatrixCollector, covered_tensors, dense_tensors
from ..families import FamilyAdapter, MoEWeights
from ..kernels.mxfp4 import ScaleRule
from ..quantization.compensation import LayerErrors, layer_errors
from ..quantization.experts import QuantizedMoE, quantize_experts_calibrated, quantize_experts_rtn
from ..quantization.formats import FORMATS, OUTPUT_FORMATS, format_of, native
from ..quantization.lowrank import ADAPTER_BITS, ALLOCATIONS, LOAD_WEIGHTINGS, allocate
from ..quantization.salient import BITMAP_CODES
from ..quantization.scheme import SCHEMES, QuantizedTensor, QuantScheme
from ..quantization.schemes import SCHEME_KINDS, kind_of
from ..quantization.sensitivity import SENSITIVITIES
from ..sweep.state import LayerResult
from ..sweep.view_experts import ExpertSource
from ..vocabulary import named
from .base import InputFacts
from .options import When, check_declared, option, recipe_only

TARGETS: tuple[str, ...] = ("experts", "shared_experts", "attention", "lm_head")
METHODS: tuple[str, ...] = ("rtn", "gptq")
GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)

GPTQ = When(named("method", "gptq"), lambda c: c.method == "gptq")


def _reads(setting: str) -> Callable[[Any], bool]:
    return lambda c: setting in getattr(SCHEME_KINDS.get(c.scheme), "settings", ())


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _reading(setting: str) -> list[str]:
    return [name for name, kind in SCHEME_KINDS.items() if setting in kind.settings]


INTEGER = When(f"{named('scheme')} {_either(_reading('symmetric'))}", _reads("symmetric"))
MXFP4 = When(named("scheme", _either(_reading("scale_rule"))), _reads("scale_rule"))
SALIENT = When(f"{named('salient_fraction')} above 0", lambda c: c.salient_fraction > 0)
BUDGET = When(f"{named('lowrank_budget')} above 0", lambda c: c.lowrank_budget > 0)
ADAPTERS = When(
    f"{named('lowrank_budget')} or {named('lowrank_rank')} above 0",
    lambda c: c.lowrank_budget > 0 or c.lowrank_rank > 0,
)
CALIBRATED = When(
    f"calibration ({named('method', 'gptq')}, {named('salient_fraction')}, low-rank adapters or "
    f"{named('imatrix_out')})",
    lambda c: (
        c.method == "gptq"
        or c.salient_fraction > 0
        or c.lowrank_budget > 0
        or c.lowrank_rank > 0
        or c.imatrix_out is not None
    ),
)


GROUP_SIZE_HELP = (
    "Weights per scale: int4, int2 and w4a8 take 32, 64 or 128 (default 32); binary 32, 64, 128 or 256 (default "
    "128); mxfp4 blocks are always 32 wide and k-quant super-blocks 256, so those refuse any other value."
)


@dataclass(frozen=True)
class QuantizeConfig:
    scheme: str = field(
        default="mxfp4",
        metadata=option(
            "mxfp4: OCP MXFP4 (E2M1, 32-wide E8M0 blocks); int4/int2: group-wise integers; w4a8: int4 weights with "
            "int8 per-token activations at inference; binary: sign bits with a bf16 scale per group (use with "
            "--salient-fraction); q2_k..q6_k: GGML k-quants (256-weight super-blocks stored as GGML's bytes; other "
            "widths take llama.cpp's fallback: Q4_0 for q2_k/q3_k, Q5_0, Q5_1, Q8_0 for q4_k, q5_k, q6_k; gptq fits "
            "each block's GGML scales and mins on the weights as corrected so far, then rounds column by column).",
            choices=SCHEMES,
        ),
    )
    method: str = field(
        default="rtn",
        metadata=option(
            "rtn: round to nearest, no calibration (streams at disk speed); gptq: per-expert GPTQ on the "
            "calibration tokens routed to each expert.",
            choices=METHODS,
        ),
    )
    group_size: int | None = field(default=None, metadata=option(GROUP_SIZE_HELP, choices=GROUP_SIZES))
    symmetric: bool | None = field(
        default=None,
        metadata=option(
            "Integer grid centred on zero, or with a per-group zero point (default: symmetric, asymmetric for int2).",
            flag="--symmetric/--asymmetric",
            applies=INTEGER,
        ),
    )
    scale_rule: ScaleRule = field(
        default="floor",
        metadata=option(
            "MXFP4 block exponent: floor(log2 amax) - 2 (OCP) or ceil(log2(amax/6)) (gpt-oss, never saturates).",
            applies=MXFP4,
        ),
    )
    salient_fraction: float = field(
        default=0.0,
        metadata=option(
            "Share of each routed expert matrix's weights kept exactly in bf16, the largest |w| x input RMS over "
            "the calibration tokens routed to the expert (needs calibration; native format only). 0.01 suits "
            "binary.",
            min=0,
            max=0.5,
        ),
    )
    bitmap: str = field(
        default="rice",
        metadata=option(
            "How the salient weights' positions are stored: a Rice- or Golomb-coded bitmap (within 1% of H(p) "
            "bits per position; Rice decodes faster) or raw (one bit per position, for comparison).",
            choices=BITMAP_CODES,
            applies=SALIENT,
        ),
    )
    targets: tuple[str, ...] = field(
        default=("experts",),
        metadata=option(
            "Comma-separated: experts (routed), shared_experts, attention, lm_head. Routers and norms are never "
            "quantised."
        ),
    )
    format: str = field(
        default="native",
        metadata=option(
            "native: loads in transformers after `import moecompress`; gpt-oss: GPT-OSS's own MXFP4 layout "
            "(stock transformers); compressed-tensors: what vLLM serves.",
            choices=FORMATS,
        ),
    )
    gptq_min_tokens: int = field(
        default=64,
        metadata=option(
            "Experts routed fewer calibration tokens fall back to rtn (listed in the report).", min=1, applies=GPTQ
        ),
    )
    gptq_damp: float = field(
        default=0.01,
        metadata=option(
            "GPTQ: added to the Hessian's diagonal as this fraction of its mean, for a stable inverse.",
            min=0,
            min_open=True,
            applies=GPTQ,
        ),
    )
    gptq_block: int = field(
        default=128, metadata=recipe_only("GPTQ: columns quantised per block.", min=1, applies=GPTQ)
    )
    lowrank_budget: float = field(
        default=0.0,
        metadata=option(
            "Low-rank error adapters after quantisation, in bits per routed expert weight (e.g. 0.25); bf16 "
            "adapters whose rank is spent where calibration tokens go. 0 disables.",
            min=0,
        ),
    )
    lowrank_rank: int = field(
        default=0,
        metadata=option(
            "The same adapter rank for every routed expert matrix (instead of --lowrank-budget).",
            flag="--adapter-rank",
            min=1,
            cli_default=None,
        ),
    )
    rank_alloc: str = field(
        default="load",
        metadata=option(
            "load: one budget over every expert matrix, largest load × σ² first; uniform: the same rank everywhere.",
            choices=ALLOCATIONS,
            applies=BUDGET,
        ),
    )
    load_weighting: str = field(
        default="gate",
        metadata=option(
            "gate: each routed token counts with its squared routing weight (the block-output error); tokens: "
            "every routed token counts alike (an expert's load is its share of routed tokens).",
            choices=LOAD_WEIGHTINGS,
            applies=ADAPTERS,
        ),
    )
    sensitivity: str = field(
        default="fisher-token",
        metadata=option(
            "Downstream weight of each token's adapter error, from one gradient pass over the calibration data "
            "(streamed layer by layer, each layer read twice): fisher-token: ‖∂loss/∂block output‖² per token; "
            "fisher: its mean per layer; none: 1 (skips the pass).",
            choices=SENSITIVITIES,
            applies=ADAPTERS,
        ),
    )
    """Downstream factor on the low-rank objective (see :mod:`..quantization.sensitivity`)."""
    lowrank_min_tokens: int = field(
        default=64,
        metadata=recipe_only(
            "Experts routed fewer calibration tokens get adapters from a plain SVD of their error (not whitened).",
            min=1,
            applies=ADAPTERS,
        ),
    )
    seed: int = field(default=0, metadata=option("Seed for calibration windows.", applies=CALIBRATED))
    mtp: str = field(
        default="keep",
        metadata=option(
            "Multi-token-prediction layers (DeepSeek-V3/R1, Kimi-K2, GLM-4.5 layer num_hidden_layers; Qwen3-Next, "
            "Qwen3.5 mtp.*): keep (quantised like the main layers, calibrated on the inputs the MTP module computes; "
            "the plugin skips them) or drop (not written, the MTP layer count 0).",
            choices=MTP_MODES,
        ),
    )
    imatrix_out: str | None = field(
        default=None,
        metadata=option(
            "Also write what the calibration measured as a llama.cpp importance matrix (GGUF, llama-imatrix's "
            "format) to this file, for llama-quantize to read: the input sums of squares and token counts of every "
            "matrix it quantises (attention, router, routed experts per expert, shared expert, dense MLP, an untied "
            "output head; docs/llama_cpp.md). Runs the calibration sweep even with --method rtn.",
        ),
    )

    def quant_scheme(self) -> QuantScheme:
        """``symmetric`` and the group size default to the scheme's own (``SchemeKind.default_symmetric``,
        ``default_group_size``: asymmetric for INT2, group 128 for binary); a fixed block width overrides."""
        try:
            kind = kind_of(self.scheme)
            symmetric = self.symmetric if self.symmetric is not None else kind.default_symmetric
            group = kind.fixed_group_size or self.group_size or kind.default_group_size
            return QuantScheme(self.scheme, group, symmetric, self.scale_rule, self.salient_fraction, self.bitmap)
        except ValueError as error:
            if "group size" in str(error):
                raise OptionError(f"{named('group_size', group)}: {error}", QuantizeConfig) from None
            raise UserInputError(str(error)) from None

    def validate(self) -> None:
        def refuse(template: str) -> OptionError:
            return OptionError(template, QuantizeConfig)

        check_declared(self)
        fixed = kind_of(self.scheme).fixed_group_size
        if fixed is not None and self.group_size not in (None, fixed):
            raise refuse(f"{named('group_size', self.group_size)}: {self.scheme} blocks are always {fixed} wide")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or "experts" not in self.targets:
            raise refuse(
                f"{named('targets', self.targets)}: targets must include experts and be among {', '.join(TARGETS)}"
            )
        if self.lowrank_rank and self.lowrank_budget:
            raise refuse(f"give either {named('lowrank_rank')} or {named('lowrank_budget')}, not both")
        layout = format_of(self.format)
        if self.salient_fraction and not layout.holds_salient:
            raise refuse(
                f"{named('salient_fraction')}: salient weights are stored in the {_holding('holds_salient')} format "
                f"only, not {named('format', self.format)}"
            )
        if self.imatrix_out is not None and not self.imatrix_out.strip():
            raise refuse(f"{named('imatrix_out', self.imatrix_out)}: name a file")
        if (self.lowrank_budget or self.lowrank_rank) and not layout.holds_adapters:
            raise refuse(
                f"{named('lowrank_budget') if self.lowrank_budget else named('lowrank_rank')}: low-rank adapters are "
                f"stored in the {_holding('holds_adapters')} format only, not {named('format', self.format)}"
            )
        self.quant_scheme()

    def check_input(self, facts: InputFacts) -> None:
        """Refuse, before any work, an input this scheme and format cannot be applied to or would not shrink,
        and an importance-matrix file that could not be written for it."""
        from ..runner.preflight import check_output_smaller

        if facts.quantized:
            native_refusal(facts.adapter.config, str(facts.model_dir))
        _check_format(facts.adapter, self, self.quant_scheme())
        check_output_smaller(facts.model_dir, self)
        if self.imatrix_out is not None:
            from ..export.imatrix import check_imatrix_target

            check_imatrix_target(Path(self.imatrix_out), facts.adapter, [facts.model_dir], QuantizeConfig)


def _holding(place: str) -> str:
    """The formats with ``place`` (an :class:`OutputFormat` flag), for a refusal."""
    return _either([name for name, layout in OUTPUT_FORMATS.items() if getattr(layout, place)])


def _check_format(adapter: FamilyAdapter, config: QuantizeConfig, scheme: QuantScheme) -> None:
    reason = format_of(config.format).unsupported(adapter, scheme, tuple(config.targets))
    if reason:
        raise OptionError(reason, QuantizeConfig)


def _refuse_quantized_input(source: dict[str, Any], model_dir: Path) -> None:
    """A quantised release is decoded on read; only moecompress's own native output is refused."""
    native_refusal(source, str(model_dir))


class _TensorQuantizer:
    """RTN for the non-expert targets; records the on-disk key of every weight it quantises."""

    def __init__(self, adapter: FamilyAdapter, scheme: QuantScheme, targets: tuple[str, ...]):
        self.adapter, self.scheme, self.targets = adapter, scheme, set(targets)
        self.keys: list[str] = []

    def wanted(self, key: str, tensor: torch.Tensor) -> bool:
        if not key.endswith(".weight") or tensor.ndim != 2 or not tensor.is_floating_point():
            return False
        kind = self.adapter.classify_key(key)
        if kind == "embeddings":
            return "lm_head" in self.targets and (key.startswith("lm_head") or key.endswith(".lm_head.weight"))
        return kind in self.targets and kind in ("shared_experts", "attention")

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | QuantizedTensor]:
        out: dict[str, torch.Tensor | QuantizedTensor] = {}
        for key, tensor in tensors.items():
            if not self.wanted(key, tensor):
                out[key] = tensor
                continue
            problem = self.scheme.width_problem(tensor.shape[-1])
            if problem:
                raise OptionError(
                    f"{key}: {problem}; drop this target or pick another {named('group_size')}", QuantizeConfig
                )
            out[key] = self.scheme.quantize(tensor)
            self.keys.append(key)
        return out


def _check_expert_dims(layer: int, moe: MoEWeights, scheme: QuantScheme) -> None:
    for name, tensor in (("gate_up", moe.gate_up), ("down", moe.down)):
        problem = scheme.width_problem(tensor.shape[-1])
        if problem:
            raise UserInputError(f"layer {layer}: expert {name}: {problem}")


class _ExpertQuantizer:
    """Quantises each MoE layer's routed experts: RTN, or GPTQ on the capture; then, in the rewriting sweep,
    attaches the low-rank adapters the allocation gave each matrix."""

    def __init__(self, adapter: FamilyAdapter, scheme: QuantScheme, config: QuantizeConfig):
        self.adapter, self.scheme, self.config = adapter, scheme, config
        self.calibrated = config.method == "gptq" or scheme.salient_fraction > 0
        """GPTQ and the choice of salient weights both need each expert's routed calibration inputs."""
        self.sensitivity: dict[int, torch.Tensor] = {}
        """Per MoE layer, the factor on its error in the low-rank objective: a scalar on its loads, or one weight
        per calibration token (absent: 1)."""

    def quantize(self, layer: int, moe: MoEWeights, capture) -> QuantizedMoE:
        _check_expert_dims(layer, moe, self.scheme)
        if not self.calibrated:
            return quantize_experts_rtn(moe, self.scheme)
        quantized = quantize_experts_calibrated(
            self.adapter,
            moe,
            capture.moe_input,
            self.scheme,
            method=self.config.method,
            min_tokens=self.config.gptq_min_tokens,
            damp=self.config.gptq_damp,
            block_size=self.config.gptq_block,
            router_input=capture.router_input,
            token_ids=capture.token_ids,
            sequence_lengths=capture.sequence_lengths,
        )
        capture.replacement = ExpertSource(quantized.weights, quantized.dequantized_expert)
        return quantized

    def errors(self, moe: MoEWeights, quantized: QuantizedMoE, capture, keep: int | dict, measure: bool) -> LayerErrors:
        """Measuring (``keep`` 0): the σ² of every matrix (of the experts ``capture.keep`` names, where a pruning
        pass already chose them). Rewriting (``keep`` the ranks, ``measure``): the factors of the matrices given
        components, and the measured error."""
        factor = self.sensitivity.get(capture.layer)
        errors = layer_errors(
            self.adapter,
            moe,
            quantized,
            capture.moe_input,
            keep=keep,
            min_tokens=self.config.lowrank_min_tokens,
            weighting=self.config.load_weighting,
            measure=measure,
            token_weights=factor if factor is not None and factor.ndim else None,
            only_kept=measure,
            experts=None if measure else capture.keep,
            router_input=capture.router_input,
            token_ids=capture.token_ids,
            sequence_lengths=capture.sequence_lengths,
        )
        if factor is not None and not factor.ndim:
            errors.loads = {key: load * float(factor) for key, load in errors.loads.items()}
        return errors


def _components_for_budget(budget_bits: float, moe_shapes: list[tuple[int, ...]]) -> int:
    """Rank-1 components (each ``H + I`` bf16 parameters) that ``budget_bits`` per routed expert weight buys
    (``moe_shapes``: ``(E, H, I)``, then the matrices per expert where not 3 gate/up/down)."""
    weights = sum(
        (matrices[0] if matrices else 3) * experts * hidden * inter for experts, hidden, inter, *matrices in moe_shapes
    )
    costs = {hidden + inter for _, hidden, inter, *_ in moe_shapes}
    if len(costs) != 1:
        raise UserInputError("low-rank allocation needs every MoE layer to share hidden and expert sizes")
    return int(budget_bits * weights / ADAPTER_BITS) // costs.pop()


def measure_layer(quantizer: _ExpertQuantizer, capture) -> LayerResult:
    """One layer of the measuring sweep: its expert matrices' error spectra (σ² only) and loads."""
    moe = capture.moe
    quantized = quantizer.quantize(capture.layer, moe, capture)
    errors = quantizer.errors(moe, quantized, capture, keep=0, measure=False)
    tensors = {f"{expert}.{which}": spectrum.sigma2 for (expert, which), spectrum in errors.spectra.items()}
    meta = {
        "loads": [[expert, which, errors.loads[(expert, which)]] for expert, which in errors.spectra],
        "shape": [moe.num_experts, moe.gate_up.shape[-1], moe.intermediate_size, 3 if moe.gated else 2],
    }
    return tensors, meta


def quantize_checkpoint(
    model_dir: Path,
    out_dir: Path,
    config: QuantizeConfig,
    *,
    calib: str = DEFAULT_DATA,
    calib_tokens: int = DEFAULT_CALIB_TOKENS,
    seq_len: int = DEFAULT_SEQ_LEN,
    eval_data: str | None = None,
    eval_tokens: int | None = DEFAULT_EVAL_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
    resume: bool = False,
) -> dict[str, Any]:
    """Quantise ``model_dir`` into ``out_dir`` (one quantize pass of the pipeline, :mod:`moecompress.runner.pipeline`);
    returns the report also saved as moecompress_report.json. With ``eval_data`` the output is evaluated against
    the input; with ``resume`` a killed run continues with the same bytes."""
    from ..runner.pipeline import run_one_pass

    return run_one_pass(
        "quantize",
        config,
        model_dir,
        out_dir,
        calib=calib,
        calib_tokens=calib_tokens,
        seq_len=seq_len,
        image_size=DEFAULT_IMAGE_SIZE,
        eval_data=eval_data,
        eval_tokens=eval_tokens,
        overwrite=overwrite,
        progress=progress,
        resume=resume,
    )


def _allocate_ranks(config: QuantizeConfig, gains: dict, loads: dict, shapes: list) -> tuple[dict, dict[str, Any]]:
    """One rank budget spent over every expert matrix of every layer (or a uniform rank)."""
    max_rank = min(min(hidden, inter) for _, hidden, inter, *_ in shapes)
    if config.lowrank_rank:
        components = min(config.lowrank_rank, max_rank) * len(gains)
        ranks = allocate(gains, loads, components, "uniform", max_rank=max_rank)
    else:
        components = _components_for_budget(config.lowrank_budget, shapes)
        ranks = allocate(gains, loads, components, config.rank_alloc, max_rank=max_rank)
    predicted_none = sum(loads[k] * float(g.sum()) for k, g in gains.items())
    predicted = sum(loads[k] * float(g[ranks[k] :].sum()) for k, g in gains.items())
    return ranks, {
        "budget_bits_per_expert_weight": config.lowrank_budget,
        "components": components,
        "components_used": sum(ranks.values()),
        "allocation": "uniform" if config.lowrank_rank else config.rank_alloc,
        "rank": config.lowrank_rank or None,
        "load_weighting": config.load_weighting,
        "sensitivity_mode": config.sensitivity,
        "predicted_weighted_error": {"without_adapters": predicted_none, "with_adapters": predicted},
    }


class QuantizedLayers:
    """The quantisation pass's rewriting work, layer after layer: quantise a block (and attach the low-rank
    adapters the allocation gave it), lay its tensors out in the chosen format, and accumulate what the config and
    the report need. Everything accumulated per layer is journalled with the layer's unit (:meth:`unit_meta`), so
    a resumed run restores it (:meth:`restore`) for the layers it does not redo, in the same order."""

    def __init__(
        self,
        report: dict[str, Any],
        lowrank_report: dict[str, Any] | None,
        layout,
        tensors: _TensorQuantizer,
        quantizer: _ExpertQuantizer,
        ranks: dict,
        imatrix: ImatrixCollector | None = None,
    ):
        self.report, self.lowrank_report, self.layout = report, lowrank_report, layout
        self.tensors, self.quantizer, self.ranks = tensors, quantizer, ranks
        self.imatrix = imatrix
        self.expert_modules: list[str] = []
        self.layer_stats: dict[str, Any] = {}
        self.lowrank_ranks: dict[str, dict[str, list[int]]] = {}
        self.salient: dict[str, dict[str, list[int]]] = {}
        self.measured = {"without_adapters": 0.0, "with_adapters": 0.0}
        self.pending: dict[str, Any] = {}
        self._layer_meta: dict[int, dict[str, Any]] = {}
        report["layers"] = self.layer_stats

    def quantize_moe(self, layer: int, moe: MoEWeights, capture) -> QuantizedMoE:
        meta: dict[str, Any] = {}
        quantizer = self.quantizer
        if self.imatrix is not None:
            self.imatrix.add(
                layer, moe, capture.moe_input, capture.router_input, capture.token_ids, capture.sequence_lengths
            )
        quantized = quantizer.quantize(layer, moe, capture)
        if self.ranks:
            layer_ranks = {(e, w): r for (lay, e, w), r in self.ranks.items() if lay == layer}
            errors = quantizer.errors(moe, quantized, capture, keep=layer_ranks, measure=True)
            quantized.adapters = {key: errors.spectra[key].adapter(r) for key, r in layer_ranks.items() if r}
            meta["measured"] = list(errors.measured)
            meta["lowrank_ranks"] = {
                which: [layer_ranks.get((e, which), 0) for e in range(moe.num_experts)]
                for which in ("gate", "up", "down")
            }
            quantized.stats["lowrank_ranks"] = meta["lowrank_ranks"]
            quantized.stats["lowrank_plain_svd"] = errors.plain_svd
        self._layer_meta[layer] = meta
        return quantized

    def restore(self, unit: str, meta: dict[str, Any]) -> None:
        self.tensors.keys.extend(meta["tensor_keys"])
        self.salient.update(meta.get("salient", {}))
        if "layer" not in meta:
            return
        modules = native.experts_modules(self.quantizer.adapter, meta["layer"])
        if self.imatrix is not None:
            self.imatrix.restore(meta["layer"])
        self.expert_modules.extend(modules)
        self.layer_stats[str(meta["layer"])] = meta["stats"]
        if "lowrank_ranks" in meta:
            for index, module in enumerate(modules):
                # the view holds the modules' experts in equal consecutive parts
                self.lowrank_ranks[module] = {
                    which: ranks[index * len(ranks) // len(modules) : (index + 1) * len(ranks) // len(modules)]
                    for which, ranks in meta["lowrank_ranks"].items()
                }
            self.measured["without_adapters"] += meta["measured"][0]
            self.measured["with_adapters"] += meta["measured"][1]

    def join_layer(self, layer: int, quantized: QuantizedMoE | None, rest: dict[str, torch.Tensor]) -> dict:
        """The layer's tensors as written (``quantized`` from :meth:`quantize_moe`, None for a dense layer)."""
        tensors = self.tensors
        first_key = len(tensors.keys)
        meta = self._layer_meta.pop(layer, {})
        if quantized is not None:
            meta.update(layer=layer, stats=quantized.stats)
        written = self.layout.layer_tensors(self.quantizer.adapter, layer, quantized, tensors(rest))
        meta.update(tensor_keys=tensors.keys[first_key:], salient=native.salient_sizes(written))
        del tensors.keys[first_key:]
        self.pending[layer_unit(layer)] = meta
        self.restore(layer_unit(layer), json.loads(json.dumps(meta)))
        return written

    def write_outside(self, outside: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        first_key = len(self.tensors.keys)
        written = self.layout.outside_tensors(self.quantizer.adapter, self.tensors(outside))
        self.pending[OUTSIDE_UNIT] = {"tensor_keys": self.tensors.keys[first_key:]}
        return written

    def unit_meta(self, unit: str) -> Any:
        return self.pending.pop(unit)

    def finish_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with the quantisation config of everything written. Called once every layer is written and
        before the output appears: the importance matrix (if asked for) is written here, so that a finished
        output always has it."""
        if self.imatrix is not None:
            self._write_imatrix()
        adapter, scheme = self.quantizer.adapter, self.quantizer.scheme
        quantization = self.layout.config_for(
            adapter, scheme, self.expert_modules, self.tensors.keys, self.lowrank_ranks or None, self.salient or None
        )
        return {**config, "quantization_config": quantization}

    def _imatrix_metadata(self) -> dict[str, Any]:
        calibration = self.report["calibration"]
        return {
            "datasets": [calibration["source"]],
            "chunk_count": calibration["tokens"] // calibration["seq_len"],
            "chunk_size": calibration["seq_len"],
        }

    def _write_imatrix(self) -> None:
        path = Path(self.quantizer.config.imatrix_out)
        self.imatrix.write(path, **self._imatrix_metadata())

    def final_report(self) -> dict[str, Any]:
        report = self.report
        if self.imatrix is not None and "imatrix" not in report:
            # Taken once, while the collector's directory (in the writer's work directory) still exists.
            self.imatrix.finish()
            report["imatrix"] = {
                "path": str(Path(self.quantizer.config.imatrix_out).absolute()),
                "layers": self.imatrix.layers,
                "tensors_per_layer": covered_tensors(self.quantizer.adapter),
                "tensors_per_dense_layer": dense_tensors(),
                "output": self.imatrix.has(HEAD),
                **self._imatrix_metadata(),
            }
        report["rtn_fallback_experts"] = {
            layer: stats["rtn_fallback"] for layer, stats in self.layer_stats.items() if stats.get("rtn_fallback")
        }
        report["quantized_modules"] = len(self.expert_modules) + len(self.tensors.keys)
        if self.lowrank_report is not None:
            report["lowrank"] = {**self.lowrank_report, "measured_weighted_error": self.measured}
        return report
