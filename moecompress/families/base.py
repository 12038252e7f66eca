"""The family adapter: the only code that knows an architecture's names, shapes and routing rule.

An adapter turns a decoder layer's on-disk tensors into a canonical :class:`MoEWeights` view (the
transformers 5 orientation: ``gate_up`` ``[E, 2I, H]`` with the gate rows first, ``down`` ``[E, H, I]``) and back
into the exact on-disk layout it came from. Passes read and rewrite the view; they never look at key names or
``model_type``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from .routing import RoutingRule
from .token_table import renumbered, table_route

Layout = Literal["per_expert", "fused", "fused_transposed"]
QKNorm = Literal["none", "per_head", "per_projection"]
ParamClass = Literal["experts", "shared_experts", "router", "attention", "embeddings", "norms", "vision", "other"]
PARAM_CLASSES: tuple[str, ...] = (
    "experts",
    "shared_experts",
    "router",
    "attention",
    "embeddings",
    "norms",
    "vision",
    "other",
)


@dataclass
class MoEWeights:
    """The routed experts and router of one MoE block, in canonical orientation.

    ``expert_ids`` are the experts' ids in the original model (they differ from ``range(E)`` after pruning).
    ``identity_experts`` router columns follow the ``E`` FFN experts' (router rows and correction bias span
    ``E + identity_experts``): zero-computation experts whose output is their input (LongCat-Flash). They hold no
    weights, so no pass prunes or quantises them; routing and the block's output count them.
    ``expert_scale`` ``[E]`` multiplies each chosen expert's routing weight after the rule's normalisation (Gemma 4's
    ``per_expert_scale``): it is part of the routing, removed with its expert and never quantised.
    ``token_table`` ``[vocab, k]`` (integer expert positions) makes the block hash-routed (DeepSeek-V4's
    ``tid2eid``): each token's experts are its id's row, the router only weighs them (:mod:`.token_table`).
    ``output_norm`` is the weight of a norm that the family's :meth:`FamilyAdapter.expert_output` applies to each
    expert's output before its routing weight, one vector shared by every expert (Muse Spark's
    ``post_expert_norm``): kept whole by ``select()``, never quantised, and written back as a layer tensor.
    ``expert_norm`` ``[E, H]`` is the same with one weight per expert (Ergo's ``post_expert_norm``): an expert
    tensor, removed and merged with its expert, never quantised.
    """

    EXPERT_TENSORS: ClassVar[tuple[str, ...]] = ("gate_up", "down", "gate_up_bias", "down_bias", "expert_norm")
    """The per-expert weight tensors (first dimension ``E``)."""
    ROUTER_TENSORS: ClassVar[tuple[str, ...]] = ("router_weight", "router_bias", "correction_bias", "expert_scale")
    """The routing tensors (first dimension ``E``, or ``E + identity_experts`` for the router's)."""

    router_weight: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    router_bias: torch.Tensor | None = None
    correction_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    expert_ids: list[int] = field(default_factory=list)
    identity_experts: int = 0
    expert_scale: torch.Tensor | None = None
    layer: int | None = None
    """The decoder layer the block is read from, which picks its activation (:meth:`FamilyAdapter.activation_of`)."""
    token_table: torch.Tensor | None = None
    output_norm: torch.Tensor | None = None
    expert_norm: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def router_columns(self) -> int:
        """The router's expert count: the FFN experts, then the identity experts."""
        return self.num_experts + self.identity_experts

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[2]

    @property
    def gated(self) -> bool:
        """Whether ``gate_up`` holds gate and up rows (``[E, 2I, H]``) rather than up rows alone (``[E, I, H]``)."""
        return self.gate_up.shape[-2] != self.intermediate_size

    def select(self, keep: list[int]) -> MoEWeights:
        """The same block restricted to the experts at positions ``keep`` (in that order)."""
        index = torch.tensor(keep, dtype=torch.long, device="cpu")
        columns = torch.tensor(
            keep + list(range(self.num_experts, self.router_columns)), dtype=torch.long, device="cpu"
        )

        def pick(tensor: torch.Tensor | None, rows: torch.Tensor = index) -> torch.Tensor | None:
            return None if tensor is None else tensor.index_select(0, rows).contiguous()

        return replace(
            self,
            router_weight=pick(self.router_weight, columns),
            gate_up=pick(self.gate_up),
            down=pick(self.down),
            router_bias=pick(self.router_bias, columns),
            correction_bias=pick(self.correction_bias, columns),
            gate_up_bias=pick(self.gate_up_bias),
            down_bias=pick(self.down_bias),
            expert_ids=[self.expert_ids[i] for i in keep],
            expert_scale=pick(self.expert_scale),
            expert_norm=pick(self.expert_norm),
            token_table=None if self.token_table is None else renumbered(self.token_table, self.router_weight, keep),
        )


def split_gate_up(projected: torch.Tensor, inter: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(gate, up)`` of an expert's input projection (last dimension ``2I``, gate first), or ``(None, up)`` for a
    non-gated expert's (last dimension ``I``)."""
    if projected.shape[-1] == inter:
        return None, projected
    return projected[..., :inter], projected[..., inter:]


@dataclass(frozen=True)
class ModelShape:
    """What ``inspect`` reports about a model's structure, read from its config alone."""

    family: str
    model_type: str
    num_layers: int
    moe_layers: list[int]
    experts_per_layer: dict[int, int]
    top_k: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int


class FamilyAdapter:
    """Base class; one subclass per architecture family.

    Subclasses set the class attributes that name things and override the few methods whose logic differs
    (GPT-OSS's fused, transposed, interleaved experts; Qwen3-VL-MoE's nested text tower).
    """

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    auto_class: ClassVar[str] = "AutoModelForCausalLM"
    layers_prefix: ClassVar[str] = "model.layers."
    moe_disk_prefix: ClassVar[str] = "mlp."
    router_module: ClassVar[str] = "mlp.gate"
    router_key: ClassVar[str] = "gate"
    expert_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    num_experts_keys: ClassVar[tuple[str, ...]] = ("num_experts", "num_local_experts")
    shared_expert_markers: ClassVar[tuple[str, ...]] = ("shared_expert",)
    layer_returns_tuple: ClassVar[bool] = False
    """Whether the stock decoder layer returns ``(hidden, extra)`` that the decoder unpacks (GLM-5 hands its
    sparse-attention top-k to the next layer)."""
    carried_outputs: ClassVar[dict[int, str]] = {}
    """Outputs of a decoder layer the stock forward passes to the next layer: position in the layer's output tuple
    to the next layer's keyword (GLM-5's and Mistral Large 4's indexer top-k, ``prev_topk_indices``)."""
    shared_state_keyword: ClassVar[str | None] = None
    """The keyword of a dictionary the stock forward threads through every layer, written by some layers and read by
    later ones (:meth:`shared_state_sources`; Mistral Large 4's ``shared_kv_states``)."""
    block_states_argument: ClassVar[int | None] = None
    """Position, among a decoder layer's call arguments after the hidden states, of a stack ``[B, S, n, H]`` of the
    inputs of the earlier layers at block boundaries (:meth:`is_block_boundary`), which the stock forward builds
    between layers (Inkling 2's ``block_states``)."""
    block_states_reader: ClassVar[str | None] = None
    """The module after the decoder layers that reads the whole stack as its first argument (Inkling 2's
    ``final_input``, before the final norm)."""
    layer_output_extras: ClassVar[int] = 1
    """With :attr:`layer_returns_tuple`: how many outputs follow the hidden states (Switch Transformers' blocks
    return two position biases)."""
    layer_stacks: ClassVar[tuple[str, ...]] = ()
    """An encoder-decoder's layer stacks (module paths) in the view's layer order, starting at
    :meth:`stack_starts` (Switch Transformers' ``encoder.block``, ``decoder.block``); empty: one stack at
    :attr:`runtime_layers_path`."""
    encoder_output_norm: ClassVar[str | None] = None
    """The module the first stack's output passes through before every later layer reads it as
    :attr:`encoder_output_argument` (the cross-attention's input; Switch Transformers' ``encoder.final_layer_norm``)."""
    encoder_output_argument: ClassVar[int | None] = None
    """Position, among a later stack's layer arguments after the hidden states, of the encoder's output."""
    experts_one_hot_dispatch: ClassVar[bool] = False
    """Whether the stock block calls its experts module with a one-hot dispatch ``[T, 1, E]`` in place of the top-k
    ids (Switch Transformers); the plugin's quantised experts are then called so."""
    per_sequence_routing: ClassVar[bool] = False
    """Whether what a token's expert computes for it depends on the other tokens of its sequence (Switch
    Transformers' expert capacity): the sweep records each capture's sequence lengths and the passes route whole
    sequences through :meth:`sequence_routing`."""
    has_correction_bias: ClassVar[bool] = False
    accepts_images: ClassVar[bool] = False
    attention_module: ClassVar[str] = "self_attn"
    attention_weights_output: ClassVar[int] = 1
    """Where :attr:`attention_module`'s output tuple holds the attention weights (T5's attention returns its
    position bias before them)."""
    head_pruning: ClassVar[bool] = False
    qk_norm: ClassVar[QKNorm] = "none"
    reads_token_ids: ClassVar[bool] = False
    """Whether the model reads the token ids besides their embeddings (Qwen4-Exp's per-layer n-gram embeddings), so
    that the head's skeleton cannot be fed zero embeddings in their place."""
    gated_experts: ClassVar[bool] = True
    """Whether an expert gates its up projection (gate, up, down); otherwise it is up, activation, down (the view's
    ``gate_up`` then holds the up rows alone, ``[E, I, H]``, and :meth:`activation` gets ``gate=None``)."""
    expert_scale_name: ClassVar[str | None] = None
    """The router tensor (beside its weight) that holds :attr:`MoEWeights.expert_scale` (Gemma 4:
    ``per_expert_scale``), or None."""
    router_transposed: ClassVar[bool] = False
    """Whether the router's weight is stored ``[H, E]`` on disk (Ergo's ``gate_kernel``), not ``[E, H]``."""
    expert_output_norm: ClassVar[str | None] = None
    """The experts module's child that normalises each expert's output before its routing weight, its weight
    :attr:`MoEWeights.output_norm` (Muse Spark's ``post_expert_norm``); the plugin's quantised experts keep it."""
    latent_size_key: ClassVar[str | None] = None
    """The config key of the width the routed experts compute at where the MoE block projects its input into a
    latent space before them and back after them (Nemotron 3 Super's ``moe_latent_size``); see
    :attr:`latent_experts`."""

    # What other tools' layouts make of a family. A class declares these for its own family only: a subclass is
    # another family whose stored layout was not checked, so :meth:`_declared` does not inherit them.
    per_expert_linears: ClassVar[bool] = False
    """Whether the family's checkpoints store one (gate, up, down) linear per routed expert: what compressed-tensors
    quantises (it targets modules) and transformers 5 re-fuses on load."""
    llama_cpp_shared_expert: ClassVar[bool | None] = None
    """Set where llama.cpp's converter names the routed experts ``blk.N.ffn_{gate,up,down}_exps`` (stacked in the
    checkpoint's expert order, decoder layer N as ``blk.N``) and the router and experts read the same input: whether
    the layer also has a shared expert (``ffn_{gate,up}_shexp``) reading that input too. None: no known naming."""
    expert_set_modules: ClassVar[tuple[str, ...]] = ()
    """Where a MoE layer holds one routed-experts module per expert set, their runtime names in the order the view
    holds the sets, in equal parts (ERNIE 4.5 VL's ``mlp.text_moe.experts``, ``mlp.vision_moe.experts``); empty:
    one module, :attr:`experts_module`."""
    own_release_format: ClassVar[str | None] = None
    """The output format that is this family's own release layout (GPT-OSS's ``gpt-oss``), if any."""
    message_input_module: ClassVar[str | None] = None
    """With :attr:`loop_layers`: the module outside the layers that computes each looped layer's messages from the
    previous pass (Inkling 2 Loop's ``message_input``)."""
    message_argument: ClassVar[int] = 1
    """With :attr:`loop_layers`: the position of the messages among a looped layer's arguments after the hidden
    states (None in the first pass)."""
    attention_experts: ClassVar[bool] = False
    """Whether the attention holds routed experts of its own that stock transformers builds from the MLP experts'
    count (JetMoE's MoA): removing MLP experts removes as many of them (:meth:`attention_expert_hooks`,
    :meth:`attention_reroute_hooks`, :meth:`select_attention_experts`)."""

    def __init__(self, config: dict[str, Any]):
        self.config = config

    # ---- config ---------------------------------------------------------------------------------------
    @property
    def text_config(self) -> dict[str, Any]:
        """The config section that describes the decoder (the whole config for text-only models)."""
        return self.config

    @property
    def num_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    def num_experts_key(self, section: dict[str, Any] | None = None) -> str:
        """The key that holds the routed-expert count (configs of one family do not always agree)."""
        section = self.text_config if section is None else section
        return next((key for key in self.num_experts_keys if key in section), self.num_experts_keys[0])

    @property
    def num_experts(self) -> int:
        return int(self.text_config.get(self.num_experts_key()) or 0)

    @property
    def top_k(self) -> int:
        return int(self.text_config["num_experts_per_tok"])

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0

    def listed_moe_layer(self, layer: int, otherwise: bool) -> bool:
        """transformers' ``mlp_layer_types`` rule: layer ``layer`` is MoE where that list says ``sparse``, or as
        ``otherwise`` says for a config without the list (never, without experts)."""
        kinds = self.text_config.get("mlp_layer_types")
        return self.num_experts > 0 and (kinds[layer] == "sparse" if kinds else otherwise)

    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def experts_in_layer(self, layer: int) -> int:
        """Routed experts in ``layer``: the config's count, or a pruned checkpoint's per-layer count."""
        per_layer = self.moecompress_section().get("experts_per_layer")
        if per_layer and str(layer) in per_layer:
            return int(per_layer[str(layer)])
        return self.num_experts

    def original_expert_ids(self, layer: int) -> list[int]:
        """Original ids of ``layer``'s experts, from a pruned checkpoint's ``moecompress`` section if present."""
        kept = self.moecompress_section().get("kept_experts")
        if kept and str(layer) in kept:
            return [int(i) for i in kept[str(layer)]]
        return list(range(self.experts_in_layer(layer)))

    def identity_experts(self, layer: int) -> int:
        """Zero-computation (identity) experts the router of ``layer`` can choose beside its FFN experts."""
        return 0

    def route_ids(self, layer: int) -> list[int]:
        """Original ids of ``layer``'s router columns: its FFN experts' (:meth:`original_expert_ids`), then -1, -2...
        for its identity experts, which no pass removes (so the same in a pruned output as in its input)."""
        return self.original_expert_ids(layer) + [-1 - j for j in range(self.identity_experts(layer))]

    def stored_router_columns(self, layer: int) -> int:
        """The columns of layer ``layer``'s stored router weight (:meth:`_router_key` ``weight``): every routed and
        identity expert's, except where the checkpoint stores one router per expert set (ERNIE 4.5 VL)."""
        return self.experts_in_layer(layer) + self.identity_experts(layer)

    def first_expert_width(self, layer: int) -> int | None:
        """The intermediate size config.json declares for layer ``layer``'s expert 0 (``moe_intermediate_size``, a
        number or a per-layer list), None where it declares none."""
        width = self.text_config.get("moe_intermediate_size")
        if isinstance(width, list):
            return width[layer] if layer < len(width) and isinstance(width[layer], int) else None
        return width if isinstance(width, int) else None

    def scores_without_tokens(self, moe: MoEWeights, score: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Pruning scores ``score`` ``[E]`` of ``moe``'s experts, given how many calibration tokens each was routed
        (``counts``), with the experts that no calibration token can reach ranked by the family's rule instead
        (ERNIE 4.5 VL's vision set under text calibration); ``score`` itself for every other family."""
        return score

    def moecompress_section(self) -> dict[str, Any]:
        """What moecompress recorded in the decoder config about earlier passes (kept expert ids, counts)."""
        return self.text_config.get("moecompress") or {}

    def head_counts(self) -> tuple[int, int, int]:
        """(attention heads, KV heads, head_dim)."""
        cfg = self.text_config
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
        return heads, kv_heads, int(head_dim)

    def shape(self) -> ModelShape:
        heads, kv_heads, head_dim = self.head_counts()
        moe_layers = self.moe_layers()
        return ModelShape(
            family=self.family,
            model_type=self.config.get("model_type", ""),
            num_layers=self.num_layers,
            moe_layers=moe_layers,
            experts_per_layer={i: self.experts_in_layer(i) for i in moe_layers},
            top_k=self.top_k,
            attention_heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=int(self.text_config["hidden_size"]),
        )

    def routing_rule(self) -> RoutingRule:
        return RoutingRule(
            "softmax_topk", top_k=self.top_k, normalize=bool(self.text_config.get("norm_topk_prob", True))
        )

    def activation(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        """The expert's gated activation of the gate and up projections."""
        act = self.text_config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{self.family}: unsupported expert activation {act!r}")
        return F.silu(gate) * up

    def activation_of(self, layer: int | None) -> Callable[[torch.Tensor | None, torch.Tensor], torch.Tensor]:
        """The experts' activation in decoder layer ``layer``: :meth:`activation` for a family with one activation;
        families whose activation differs per layer (a clamp limit per layer) override this, and :meth:`activation`
        stays the family's unclamped one."""
        return self.activation

    def fused_kernel_activation(self) -> tuple[Any, ...] | None:
        """The fused MoE kernel's activation computing :meth:`activation` (its name, then its constants, as
        :class:`~moecompress.kernels.triton_moe.Activation` takes them), or None where the kernel has none."""
        if type(self).activation is FamilyAdapter.activation and self.text_config.get("hidden_act", "silu") in (
            "silu",
            "swish",
        ):
            return ("silu",)
        return None

    def _declared(self, name: str) -> Any:
        return vars(type(self)).get(name, getattr(FamilyAdapter, name))

    def per_expert_linears_on_disk(self) -> bool:
        return self._declared("per_expert_linears")

    def llama_cpp_naming(self) -> bool | None:
        """:attr:`llama_cpp_shared_expert` as this family declares it."""
        return self._declared("llama_cpp_shared_expert")

    def release_format(self) -> str | None:
        return self._declared("own_release_format")

    def activation_varies(self) -> bool:
        """Whether the experts' activation differs from :meth:`activation` in some layer (what an output format
        with one activation per model cannot express)."""
        return False

    def expert_hidden(self, projected: torch.Tensor, inter: int, layer: int | None = None) -> torch.Tensor:
        """The down projection's input from an expert's input projection ``projected`` ``[T, 2I]`` (gate columns
        first) or, for non-gated experts, ``[T, I]``, with layer ``layer``'s activation."""
        return self.activation_of(layer)(*split_gate_up(projected, inter))

    @property
    def fused_in_name(self) -> str:
        """The fused experts' input projection's name: ``gate_up_proj``, or ``up_proj`` for non-gated experts."""
        return "gate_up_proj" if self.gated_experts else "up_proj"

    def transformers_config(self) -> Any:
        """The transformers config object to build the model from, or None where transformers reads
        ``config.json`` itself (families whose config names a model type transformers does not know)."""
        return None

    # ---- keys -----------------------------------------------------------------------------------------
    def layer_prefix(self, layer: int) -> str:
        return f"{self.layers_prefix}{layer}."

    def layer_of_key(self, key: str) -> int | None:
        """The decoder layer a key belongs to, or None for embeddings, final norm, head, vision tower."""
        if not key.startswith(self.layers_prefix):
            return None
        rest = key[len(self.layers_prefix) :]
        head = rest.split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def classify_key(self, key: str) -> ParamClass:
        """Which parameter class a tensor belongs to, for footprint reports."""
        if self.is_vision_key(key):
            return "vision"
        if "embed_tokens" in key or key.startswith("lm_head") or key.endswith("lm_head.weight"):
            return "embeddings"
        layer = self.layer_of_key(key)
        if layer is None:
            return "norms" if "norm" in key else "other"
        local = key[len(self.layer_prefix(layer)) :]
        blocks = (self.moe_disk_prefix, self.moe_block_name + ".")
        if any(local.startswith(f"{block}{self.router_key}.") for block in blocks) or "shared_expert_gate." in local:
            return "router"
        if any(marker in local for marker in self.shared_expert_markers):
            return "shared_experts"
        if any(local.startswith(f"{block}experts.") for block in blocks):
            return "experts"
        if "attn" in local:
            return "attention"
        if "norm" in local:
            return "norms"
        return "other"

    def is_vision_key(self, key: str) -> bool:
        return False

    def is_block_boundary(self, layer: int) -> bool:
        """Whether layer ``layer``'s input joins the :attr:`block_states_argument` stack of the layers after it."""
        return False

    def shared_state_sources(self, layer: int) -> list[int]:
        """The earlier layers whose entries in the :attr:`shared_state_keyword` dictionary layer ``layer`` reads."""
        return []

    def stored_local_name(self, runtime_local: str) -> str:
        """The name a quantised checkpoint stores a layer-local tensor or module under, from its runtime name: the
        runtime name itself, except where transformers' conversion mapping would rename it again at load (Mistral
        Large 4's native names)."""
        return runtime_local

    def runtime_name_of_stored(self, stored_local: str) -> str:
        """The inverse of :meth:`stored_local_name`."""
        return stored_local

    # ---- layer tensors <-> MoE view ---------------------------------------------------------------------
    def _expert_key(self, layer: int, expert: int, which: int) -> str:
        return f"{self.layer_prefix(layer)}{self.moe_disk_prefix}experts.{expert}.{self.expert_names[which]}.weight"

    def _fused_key(self, layer: int, name: str) -> str:
        return f"{self.layer_prefix(layer)}{self.moe_disk_prefix}experts.{name}"

    def _router_key(self, layer: int, name: str) -> str:
        return f"{self.layer_prefix(layer)}{self.moe_disk_prefix}{self.router_key}.{name}"

    def detect_layout(self, layer: int, keys: set[str] | dict) -> Layout:
        if self._expert_key(layer, 0, 0 if self.gated_experts else 1) in keys:
            return "per_expert"
        if self._fused_key(layer, self.fused_in_name) in keys:
            return "fused"
        raise KeyError(
            f"layer {layer}: no expert tensors found under {self.layer_prefix(layer)}{self.moe_disk_prefix}experts"
        )

    def split_layer(
        self, layer: int, tensors: dict[str, torch.Tensor], *, consume: bool = False
    ) -> tuple[MoEWeights | None, dict[str, torch.Tensor], Layout | None]:
        """Separate a layer's tensors into the MoE view and everything else (attention, norms, shared experts).

        Returns ``(moe, rest, layout)``; ``moe`` and ``layout`` are None for a dense layer. With ``consume`` the
        caller hands ``tensors`` over: it is emptied, and each expert tensor is freed once it is stacked.
        Values may be :class:`~moecompress.checkpoint.reader.PendingTensor` s: per-expert weights are then read
        straight into the stacked experts, everything else is read first.
        """
        from ..checkpoint.reader import materialise

        rest = dict(tensors)
        if consume:
            tensors.clear()
        if not self.is_moe_layer(layer):
            return None, {key: materialise(value) for key, value in rest.items()}, None
        layout = self.detect_layout(layer, rest)
        per_expert = re.compile(re.escape(f"{self.layer_prefix(layer)}{self.moe_disk_prefix}experts.") + r"\d+\.")
        for key, value in rest.items():
            if layout != "per_expert" or not per_expert.match(key):
                rest[key] = materialise(value)
        moe = self._pop_experts(layer, rest, layout)
        moe.router_weight = rest.pop(self._router_key(layer, "weight"))
        moe.router_bias = rest.pop(self._router_key(layer, "bias"), None)
        if self.has_correction_bias:
            moe.correction_bias = rest.pop(self._router_key(layer, "e_score_correction_bias"), None)
        if self.expert_scale_name:
            moe.expert_scale = rest.pop(self._router_key(layer, self.expert_scale_name))
        moe.expert_ids = self.original_expert_ids(layer)
        moe.identity_experts = self.identity_experts(layer)
        moe.layer = layer
        self._check_shapes(layer, moe)
        return moe, rest, layout

    def _check_shapes(self, layer: int, moe: MoEWeights) -> None:
        """Config and weights must agree before any pass trusts either."""
        from ..errors import UserInputError

        where = f"layer {layer} ({self.layer_prefix(layer)}{self.moe_disk_prefix})"
        if len(moe.expert_ids) != moe.num_experts:
            raise UserInputError(
                f"{where}: config.json says {len(moe.expert_ids)} experts, weights hold {moe.num_experts}"
            )
        hidden, width = int(self.text_config["hidden_size"]), self.experts_width
        in_rows = (2 if self.gated_experts else 1) * moe.intermediate_size
        shapes = {
            "router": (tuple(moe.router_weight.shape), (moe.router_columns, hidden)),
            "gate_up": (tuple(moe.gate_up.shape), (moe.num_experts, in_rows, width)),
            "down": (tuple(moe.down.shape), (moe.num_experts, width, moe.intermediate_size)),
        }
        if moe.expert_scale is not None:
            shapes["expert scale"] = (tuple(moe.expert_scale.shape), (moe.num_experts,))
        for name, (got, want) in shapes.items():
            if got != want:
                raise UserInputError(
                    f"{where}: {name} weights have shape {list(got)}, config.json implies {list(want)}"
                )

    def join_layer(
        self, layer: int, moe: MoEWeights | None, rest: dict[str, torch.Tensor], layout: Layout | None
    ) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`split_layer`: the layer's tensors in the on-disk ``layout``."""
        out = dict(rest)
        if moe is None:
            return out
        out[self._router_key(layer, "weight")] = moe.router_weight
        if moe.router_bias is not None:
            out[self._router_key(layer, "bias")] = moe.router_bias
        if moe.correction_bias is not None:
            out[self._router_key(layer, "e_score_correction_bias")] = moe.correction_bias
        if moe.expert_scale is not None:
            out[self._router_key(layer, self.expert_scale_name)] = moe.expert_scale
        out.update(self._expert_tensors(layer, moe, layout))
        return out

    def _pop_experts(self, layer: int, rest: dict[str, torch.Tensor], layout: Layout) -> MoEWeights:
        from ..checkpoint.reader import materialise

        if layout == "fused":
            gate_up = rest.pop(self._fused_key(layer, self.fused_in_name))
            down = rest.pop(self._fused_key(layer, "down_proj"))
            return MoEWeights(router_weight=torch.empty(0, device="cpu"), gate_up=gate_up, down=down)
        pattern = re.compile(re.escape(f"{self.layer_prefix(layer)}{self.moe_disk_prefix}experts.") + r"(\d+)\.")
        count = len({int(m.group(1)) for key in rest if (m := pattern.match(key))})
        first_in = 0 if self.gated_experts else 1
        first_gate, first_down = rest[self._expert_key(layer, 0, first_in)], rest[self._expert_key(layer, 0, 2)]
        inter = first_gate.shape[0]
        rows = 2 * inter if self.gated_experts else inter
        gate_up = torch.empty((count, rows, *first_gate.shape[1:]), dtype=first_gate.dtype, device="cpu")
        down = torch.empty((count, *first_down.shape), dtype=first_down.dtype, device="cpu")
        del first_gate, first_down
        # Each expert's tensors leave ``rest`` as they are read (or copied) into place, so a layer is held once,
        # not twice, while it is stacked.
        for expert in range(count):
            for which, target in self._expert_parts(gate_up[expert], down[expert], inter):
                key = self._expert_key(layer, expert, which)
                tensor = rest.pop(key)
                if tensor.shape != target.shape:
                    from ..errors import UserInputError

                    raise UserInputError(f"{key}: shape {list(tensor.shape)}, but expert 0's is {list(target.shape)}")
                if isinstance(tensor, torch.Tensor) or tensor.dtype != target.dtype:
                    target.copy_(materialise(tensor))
                else:
                    tensor.load_into(target)
                del tensor
        return MoEWeights(router_weight=torch.empty(0, device="cpu"), gate_up=gate_up, down=down)

    def _expert_parts(
        self, gate_up: torch.Tensor, down: torch.Tensor, inter: int
    ) -> tuple[tuple[int, torch.Tensor], ...]:
        """One expert's matrices as ``(index into expert_names, tensor)``: gate rows, up rows, down (no gate for
        non-gated experts)."""
        if not self.gated_experts:
            return (1, gate_up), (2, down)
        return (0, gate_up[:inter]), (1, gate_up[inter:]), (2, down)

    def _expert_tensors(self, layer: int, moe: MoEWeights, layout: Layout | None) -> dict[str, torch.Tensor]:
        if layout == "fused":
            return {
                self._fused_key(layer, self.fused_in_name): moe.gate_up,
                self._fused_key(layer, "down_proj"): moe.down,
            }
        inter = moe.intermediate_size
        out = {}
        for expert in range(moe.num_experts):
            for which, tensor in self._expert_parts(moe.gate_up[expert], moe.down[expert], inter):
                out[self._expert_key(layer, expert, which)] = tensor.contiguous()
        return out

    # ---- the loaded transformers model ------------------------------------------------------------------
    @property
    def runtime_layers_path(self) -> str:
        """The decoder layers' module path in the loaded model: the on-disk prefix, except for releases whose
        names transformers renames at load (Kimi-K2.5's ``language_model.model.layers``)."""
        return self.layers_prefix.rstrip(".")

    def runtime_module_name(self, name: str) -> str:
        """A module's name in the loaded model, from its on-disk name (``quantization_config`` lists the latter)."""
        return name

    def runtime_outside_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors outside the decoder layers (embeddings, final norm, head, vision tower) under the names the loaded
        model gives them, for the calibration skeleton."""
        return state

    def fix_skeleton(self, skeleton: torch.nn.Module) -> None:
        """Undo what the stock model derived at build time from the sweep skeleton's zero decoder layers (Gemma 4's
        first KV-sharing layer index)."""

    def stack_starts(self) -> tuple[int, ...]:
        """The first layer of each of :attr:`layer_stacks` (a new stack's first layer takes what the stock forward
        gives it, not the previous layer's output): ``(0,)`` for a decoder-only model."""
        return (0,)

    def sequence_routing(
        self, moe: MoEWeights, ids: torch.Tensor, weights: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """The ``weights`` of the choice ``ids`` ``[T, k]`` of tokens that are whole sequences of ``lengths``, with
        what a sequence-level rule takes away (:attr:`per_sequence_routing`) set to zero."""
        return weights

    def runtime_in_layer(self, layer: int, name: str) -> str:
        """The name in runtime layer ``layer`` of a module named relative to its MoE block's parent
        (:attr:`moe_site_module`, :attr:`experts_parent`), where that parent differs between layers (Switch
        Transformers' ``layer.1`` in the encoder, ``layer.2`` in the decoder)."""
        return name

    def decoder_layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The decoder layers of a loaded model."""
        return model.get_submodule(self.runtime_layers_path)

    def router_of(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        """Layer ``layer``'s router module; :meth:`route_of` reads its forward's output."""
        return self.decoder_layers(model)[layer].get_submodule(self.router_module)

    def route_of(self, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits, weights [T, k], top-k ids [T, k])`` from the stock router module's forward output (what a
        forward hook on :meth:`router_of` receives)."""
        return output

    def with_route(self, output: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        """The stock router's forward output ``output`` with its choice replaced by ``ids`` and ``weights``
        (what a forward hook returns to reroute)."""
        return output[0], weights.to(output[1].dtype), ids

    def stock_route(self, model: torch.nn.Module, layer: int, hidden: torch.Tensor):
        """``(logits, weights, top-k ids)`` of layer ``layer``'s stock router for tokens ``hidden`` ``[T, H]``."""
        return self.route_of(self.router_of(model, layer)(hidden))

    def stock_experts(
        self, model: torch.nn.Module, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``layer``'s stock routed-experts module run on tokens ``hidden`` routed to ``ids`` with
        ``weights``: their combined output."""
        return self.experts_of(model, layer)(hidden, ids, weights)

    def with_experts_module(self, model: torch.nn.Module) -> None:
        """Give each MoE block of ``model`` (a model or a decoder layer as transformers builds it) the module
        :attr:`experts_module` names, called as ``experts(hidden, ids, weights)``, where the stock block computes its
        experts inline (JetMoE); the plugin calls this before it places the quantised experts there."""

    def stock_experts_weights(self, module: torch.nn.Module) -> tuple[Any, Any, bool]:
        """``(input projection, down projection, gated)`` of a stock routed-experts module, from which the plugin
        sizes its quantised twin (only their shapes and dtype count): its ``gate_up_proj`` (or ``up_proj``) and
        ``down_proj``; None where it has no such tensor."""
        gated = isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
        return getattr(module, "gate_up_proj" if gated else "up_proj", None), getattr(module, "down_proj", None), gated

    @property
    def moe_block_name(self) -> str:
        """The MoE block's name inside a runtime decoder layer (the router's parent): ``mlp`` for every family."""
        return self.router_module.rsplit(".", 1)[0]

    def moe_block_of(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        return self.decoder_layers(model)[layer].get_submodule(self.moe_block_name)

    def experts_of(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        return self.decoder_layers(model)[layer].get_submodule(self.experts_module)

    @property
    def experts_module(self) -> str:
        """The routed-experts module's name inside a runtime decoder layer."""
        return f"{self.moe_block_name}.experts"

    def experts_modules(self) -> tuple[str, ...]:
        """Every routed-experts module of a MoE layer (runtime names), in the order the view holds their experts."""
        return self.expert_set_modules or (self.experts_module,)

    def experts_refusal(self, scheme: Any) -> str | None:
        """Why the routed experts cannot be written in quantisation scheme ``scheme``
        (:class:`~moecompress.quantization.scheme.QuantScheme`), or None (every scheme, but where
        :meth:`quantized_expert_sets` cuts a block into parts)."""
        return None

    def quantized_expert_sets(self, moe: Any) -> list[Any]:
        """A quantised block (:class:`~moecompress.quantization.experts.QuantizedMoE`) as the parts
        :meth:`experts_modules` hold, in that order: the block itself where a layer has one experts module."""
        return [moe]

    @property
    def experts_parent(self) -> str:
        """The name of the module that holds :attr:`experts_module` (``""``: the decoder layer itself)."""
        return self.experts_module.rpartition(".")[0]

    @property
    def moe_site_module(self) -> str:
        """The module whose input is what the routed experts compute on and whose output is the MoE output the
        passes measure: the MoE block, or the experts module where no block holds router and experts (Gemma 4) or
        where they compute in a latent space (:attr:`latent_experts`)."""
        return self.experts_module if self.latent_experts else self.moe_block_name

    @property
    def router_input_module(self) -> str | None:
        """The module in a decoder layer whose input the router's weight multiplies, where that is not the experts'
        input (Gemma 4's ``router.proj``: its router normalises and scales the residual stream itself; the router
        itself where the experts compute in a latent space); the sweep captures it there, so the stock modules
        compute it. None: the router reads the experts' input."""
        return self.router_module if self.latent_experts else None

    @property
    def latent_experts(self) -> bool:
        """Whether the MoE block maps its input into a latent space before the routed experts and their combined
        output back after them, while the router reads the block's input.

        The stock block computes both maps (they stay layer tensors outside the view, never pruned, quantised as
        the layer's other tensors are): the sweep captures the experts module's input as the MoE input and the
        router's as :attr:`router_input_module`, so every pass (frequency, ΔH, REAP, GPTQ, low-rank compensation,
        the view's forward) computes on the latent tokens, and the stock block adds the output projection."""
        return bool(self.latent_size_key and self.text_config.get(self.latent_size_key))

    @property
    def experts_width(self) -> int:
        """The width the routed experts read and write: ``hidden_size``, or the latent width
        (:attr:`latent_size_key`) where the config sets one."""
        latent = self.text_config.get(self.latent_size_key) if self.latent_size_key else None
        return int(latent or self.text_config["hidden_size"])

    def stock_experts_input(self, model: torch.nn.Module, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """What layer ``layer``'s stock routed-experts module receives when its MoE block gets tokens ``hidden``
        ``[T, H]``: ``hidden`` itself, or the latent tokens the stock block maps it to (:attr:`latent_experts`)."""
        if not self.latent_experts:
            return hidden
        seen: list[torch.Tensor] = []
        handle = self.experts_of(model, layer).register_forward_hook(lambda mod, args, out: seen.append(args[0]))
        try:
            self.moe_block_of(model, layer)(hidden.unsqueeze(0))
        finally:
            handle.remove()
        return seen[0].reshape(hidden.shape[0], -1)

    @property
    def loop_layers(self) -> range:
        """The decoder layers the stock forward runs :attr:`loop_passes` times in turn (Inkling 2 Loop's looped
        segment); empty for a family without one."""
        return range(0)

    @property
    def loop_passes(self) -> int:
        return 1

    def attention_expert_hooks(self, layer_module: torch.nn.Module, into: dict[str, Any]) -> list[Any]:
        """With :attr:`attention_experts`: forward hooks on a runtime decoder layer that add what its attention's
        router sends each attention expert to ``into`` (none by default); their handles."""
        return []

    def reroute_hooks(
        self, layer_module: torch.nn.Module, choose: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    ) -> list[Any]:
        """Forward hooks on a runtime decoder layer that replace its router's choice by ``choose(logits)``
        (``(ids, weights)``); their handles."""

        def reroute(router, inputs, output):
            ids, weights = choose(self.route_of(output)[0])
            return self.with_route(output, weights, ids)

        return [layer_module.get_submodule(self.router_module).register_forward_hook(reroute)]

    def runtime_layer_state(
        self, layer: int, moe: MoEWeights | None, rest: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """A layer's tensors named as the stock transformers decoder-layer module's state dict."""
        state = self.runtime_local_state({self.runtime_local_key(layer, key): tensor for key, tensor in rest.items()})
        if moe is not None:
            state.update(self.runtime_moe_state(moe))
        return state

    def runtime_local_key(self, layer: int, key: str) -> str:
        """The runtime name inside decoder layer ``layer`` of its on-disk ``key`` (not of the routed experts); a
        family that stores some of a layer's tensors outside its prefix (Inkling 2's block-residual queries) names
        them here."""
        return self.runtime_local_name(key[len(self.layer_prefix(layer)) :])

    def runtime_local_name(self, local_key: str) -> str:
        """The runtime name of a layer-local on-disk key that is not part of the routed experts."""
        return local_key

    def runtime_local_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A layer's tensors (routed experts aside), already under :meth:`runtime_local_name`, as the stock layer
        module holds them, for releases whose tensors transformers reshapes at load (Sarvam's fused q/k/v)."""
        return state

    def runtime_moe_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        experts = self.experts_module
        state = {f"{experts}.{self.fused_in_name}": moe.gate_up, f"{experts}.down_proj": moe.down}
        state.update(self.runtime_router_state(moe))
        return state

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        """The router's tensors (weight, bias, correction bias) under their runtime names in the decoder layer."""
        state = {f"{self.router_module}.weight": moe.router_weight}
        if moe.router_bias is not None:
            state[f"{self.router_module}.bias"] = moe.router_bias
        if moe.correction_bias is not None:
            state[f"{self.router_module}.e_score_correction_bias"] = moe.correction_bias
        if moe.expert_scale is not None:
            state[f"{self.router_module}.{self.expert_scale_name}"] = moe.expert_scale
        return state

    # ---- computation ----------------------------------------------------------------------------------
    def router_logits(self, moe: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(
            hidden.float(), moe.router_weight.float(), None if moe.router_bias is None else moe.router_bias.float()
        )

    def expert_output(self, moe: MoEWeights, expert: int, hidden: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s (a position in ``moe``, or a router column past them: an identity expert) output for
        tokens ``hidden`` ``[T, H]``, unweighted."""
        if expert >= moe.num_experts and moe.identity_experts:
            return hidden
        gate_up = F.linear(hidden, moe.gate_up[expert].to(hidden.dtype))
        if moe.gate_up_bias is not None:
            gate_up = gate_up + moe.gate_up_bias[expert].to(hidden.dtype)
        out = F.linear(self.expert_hidden(gate_up, moe.intermediate_size, moe.layer), moe.down[expert].to(hidden.dtype))
        if moe.down_bias is not None:
            out = out + moe.down_bias[expert].to(hidden.dtype)
        return out

    def route(
        self,
        moe: MoEWeights,
        logits: torch.Tensor,
        allowed: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k ids ``[T, k]`` and routing weights of ``moe``'s router logits ``[T, E]``: the family's rule, then
        the per-expert scale where the block has one. A hash-routed block (:attr:`MoEWeights.token_table`) takes
        the ids from the table rows of the tokens' ids ``token_ids`` ``[T]`` (:func:`.token_table.table_route`) and
        weighs them as the rule weighs a choice."""
        if moe.token_table is not None:
            ids = table_route(moe.token_table, moe.router_weight, token_ids, allowed).to(logits.device)
            weights = self.routing_rule().weights_for(logits, ids)
        else:
            bias = None if moe.correction_bias is None else moe.correction_bias.to(logits.device)
            ids, weights = self.routing_rule().route(logits, bias, allowed)
        if moe.expert_scale is not None:
            weights = weights * moe.expert_scale.to(weights.device).float()[ids]
        return ids, weights

    def moe_forward(
        self,
        moe: MoEWeights,
        hidden: torch.Tensor,
        allowed: torch.Tensor | None = None,
        router_input: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The routed experts' combined output for ``hidden`` ``[T, H]`` (shared experts excluded); the router reads
        ``router_input`` where it is given (:attr:`router_input_module`), otherwise ``hidden``; a hash-routed block
        routes by the tokens' ids ``token_ids``; a sequence-level rule (:attr:`per_sequence_routing`) takes
        ``hidden`` as one sequence, in order."""
        logits = self.router_logits(moe, hidden if router_input is None else router_input)
        ids, weights = self.route(moe, logits, allowed, token_ids)
        weights = self.sequence_routing(moe, ids, weights, [hidden.shape[0]])
        return self.combine_experts(hidden, ids, weights, lambda expert, x: self.expert_output(moe, expert, x))

    def combine_experts(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        output_of: Callable[[int, torch.Tensor], torch.Tensor | None],
    ) -> torch.Tensor:
        """The block's routed output for tokens ``hidden`` ``[T, H]`` routed to ``ids`` ``[T, k]`` with ``weights``:
        for each chosen expert, ``output_of(expert, its input)`` (None: the expert is skipped) weighted as the
        family's rule says, summed per token."""
        rule = self.routing_rule()
        out = torch.zeros_like(hidden)
        for expert in ids.unique().tolist():
            token_pos, slot = torch.where(ids == expert)
            weight = weights[token_pos, slot, None].to(hidden.dtype)
            contribution = output_of(expert, rule.expert_input(hidden[token_pos], weight))
            if contribution is not None:
                out.index_add_(0, token_pos, (contribution * rule.output_weight(weight)).to(out.dtype))
        return out

    def softmax_attention(self, layer: int) -> bool:
        """Whether layer ``layer`` attends with softmax attention (whose weights say how much attention each token
        receives), not with a linear-attention mixer (Gated DeltaNet, lightning attention) or a convolution (LFM2)."""
        layer_types = self.text_config.get("layer_types") or []
        if layer >= len(layer_types):
            return True
        return "attention" in layer_types[layer] and layer_types[layer] != "linear_attention"

    # ---- attention heads --------------------------------------------------------------------------------
    def check_head_pruning(self, source: str = "model") -> None:
        """A :class:`UserInputError` unless this family's attention is plain (grouped-query) multi-head attention
        whose heads can be removed: q/k/v/o projections, optional q/k norms, nothing else per head."""
        from ..errors import UserInputError

        if not self.head_pruning:
            raise UserInputError(
                f"{source}: {self.family} has no prunable grouped-query attention heads (head pruning supports "
                "mixtral, qwen2_moe, qwen3_moe and olmoe)"
            )

    def check_expert_pruning(self, source: str = "model", config: Any = None) -> None:
        """A :class:`UserInputError` where this model's experts cannot be removed consistently, or not as ``config``
        (the pass's options) asks (none by default)."""

    def check_route_replay(self, source: str = "model") -> None:
        """A :class:`UserInputError` where :meth:`with_route` cannot replay a route through this model's router
        (QAT replays the full-precision routes), raised before any work (none by default)."""

    def attention_prefix(self, layer: int) -> str:
        """On-disk (and runtime) prefix of layer ``layer``'s attention module, ending in a dot."""
        return f"{self.layer_prefix(layer)}{self.attention_module}."

    def attention_of(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        return self.decoder_layers(model)[layer].get_submodule(self.attention_module)

    def heads_in_layer(self, layer: int) -> tuple[int, int]:
        """(query heads, KV heads) of ``layer``: the config's, or a head-pruned checkpoint's per-layer counts."""
        per_layer = self.moecompress_section().get("attention_heads_per_layer")
        if per_layer and str(layer) in per_layer:
            heads, kv_heads = per_layer[str(layer)]
            return int(heads), int(kv_heads)
        heads, kv_heads, _ = self.head_counts()
        return heads, kv_heads

    def original_head_ids(self, layer: int) -> list[int]:
        """Original ids of ``layer``'s query heads, from a head-pruned checkpoint's ``moecompress`` section."""
        kept = self.moecompress_section().get("kept_heads")
        if kept and str(layer) in kept:
            return [int(i) for i in kept[str(layer)]]
        return list(range(self.heads_in_layer(layer)[0]))

    def stock_loads_head_counts(self, uniform: bool) -> bool:
        """Whether stock transformers builds the right shapes from the global head counts alone: the counts are
        uniform and no norm spans the whole projection (OLMoE sizes its q/k norms from ``hidden_size``)."""
        return uniform and self.qk_norm != "per_projection"

    def with_head_counts(self, counts: dict[int, tuple[int, int]], kept_heads: dict[int, list[int]]) -> dict[str, Any]:
        """A config for the same model after head pruning, with an explicit ``head_dim``.

        Counts that stock transformers can build rewrite ``num_attention_heads``/``num_key_value_heads``; otherwise
        the global counts stay the original ones (so stock transformers refuses the weights' shapes instead of
        loading them wrongly) and ``moecompress.attention_heads_per_layer`` tells the plugin each layer's counts.
        """
        import copy

        _, _, head_dim = self.head_counts()
        config = copy.deepcopy(self.config)
        text = self._text_section(config)
        text["head_dim"] = head_dim
        section = text.setdefault("moecompress", {})
        section["kept_heads"] = {str(layer): ids for layer, ids in sorted(kept_heads.items())}
        values = set(counts.values())
        if self.stock_loads_head_counts(len(values) == 1):
            heads, kv_heads = values.pop()
            text["num_attention_heads"], text["num_key_value_heads"] = heads, kv_heads
            section.pop("attention_heads_per_layer", None)
        else:
            section["attention_heads_per_layer"] = {str(layer): list(c) for layer, c in sorted(counts.items())}
        return config

    # ---- config rewriting -----------------------------------------------------------------------------
    def with_expert_counts(self, counts: dict[int, int], kept: dict[int, list[int]]) -> dict[str, Any]:
        """A config for the same model after expert pruning.

        Uniform counts rewrite the family's own key (every stock tool loads that); the original ids always go
        into the ``moecompress`` section so evaluation can map routes back to the original experts.
        """
        import copy

        config = copy.deepcopy(self.config)
        text = self._text_section(config)
        values = set(counts.values())
        section = text.setdefault("moecompress", {})
        section["kept_experts"] = {str(layer): ids for layer, ids in sorted(kept.items())}
        if len(values) == 1:
            text[self.num_experts_key(text)] = values.pop()
            section.pop("experts_per_layer", None)
        else:
            section["experts_per_layer"] = {str(layer): n for layer, n in sorted(counts.items())}
        return config

    def _text_section(self, config: dict[str, Any]) -> dict[str, Any]:
        return config
