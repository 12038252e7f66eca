"""Candidate MAEP scores on a Qwen3-MoE checkpoint, each pruned per layer at 25% and 50% and evaluated by masking
the removed experts' router logits in the loaded model (what deleting their router rows does for a renormalised
softmax router), on held-out prose and code.

Run: python scripts/maep_candidates.py [--model builtin:tiny-moe] [--calib builtin:prose,builtin:code] --out FILE

Candidates (higher = kept): frequency, REAP, mean ‖ΔH‖², the same weighted by s_t = ‖g_t‖²/H (g_t the gradient of
the summed next-token loss at the block output), by s_t with labels sampled from the model, (g_t·ΔH_t)², ΔH²/‖H_t‖²,
ΔH²/‖residual_t‖², the first-order loss change −g_t·ΔH_t, the measured calibration loss of each single removal,
greedy re-scoring (plain and weighted), and the exhaustive best joint removal by ‖ΔH‖² and by (g·ΔH)².
Qwen3-MoE only (it replaces the router's forward); the checkpoint is small enough to hold whole.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from moecompress.calibration.batches import consecutive_windows, tokenize_documents
from moecompress.calibration.model_inputs import calibration_batches
from moecompress.calibration.sources import load_documents
from moecompress.checkpoint import resolve_model
from moecompress.loading import load_adapter, load_model, load_tokenizer, quiet_transformers
from moecompress.passes.expert_scores import layer_expert_stats
from moecompress.sweep.engine import CalibrationSweep


class MaskedModel:
    """The loaded model with a settable set of removed experts per layer."""

    def __init__(self, model: torch.nn.Module, num_experts: int):
        self.model, self.num_experts = model, num_experts
        self.masks: dict[int, torch.Tensor | None] = {}
        for layer, module in enumerate(model.model.layers):
            self.masks[layer] = None
            module.mlp.gate.forward = self._router(module.mlp.gate, layer)

    def _router(self, gate, layer):
        def forward(hidden_states):
            logits = F.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
            if self.masks[layer] is not None:
                logits = logits.masked_fill(self.masks[layer], float("-inf"))
            top, ids = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), gate.top_k, dim=-1)
            if gate.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), ids

        return forward

    def remove(self, removed: dict[int, list[int]]) -> None:
        for layer in self.masks:
            mask = torch.zeros(self.num_experts, dtype=torch.bool)
            mask[removed.get(layer, [])] = True
            self.masks[layer] = mask if mask.any() else None

    @torch.no_grad()
    def nll(self, windows: torch.Tensor, batch: int = 16) -> float:
        total, count = 0.0, 0
        for start in range(0, windows.shape[0], batch):
            ids = windows[start : start + batch]
            log_probs = F.log_softmax(self.model(input_ids=ids).logits[:, :-1].float(), dim=-1)
            total -= log_probs.gather(-1, ids[:, 1:, None]).sum().item()
            count += ids[:, 1:].numel()
        return total / count


def block_gradients(model, batches, layers, sampled: bool):
    """Per layer, the gradient of the summed next-token loss at the MoE block output ``[T, H]`` (labels from the
    data, or sampled from the model's own distribution with a fixed seed), the block inputs, and the residual norm."""
    grads, inputs, residual = ({layer: [] for layer in layers} for _ in range(3))
    handles = []
    for layer in layers:
        module = model.model.layers[layer]

        def keep(_m, args, out, layer=layer):
            inputs[layer].append(args[0].detach().reshape(-1, args[0].shape[-1]))
            out.register_hook(lambda g, layer=layer: grads[layer].append(g.detach().reshape(-1, g.shape[-1])))

        def norm(_m, args, layer=layer):
            residual[layer].append(args[0].detach().reshape(-1, args[0].shape[-1]).norm(dim=-1))

        handles += [
            module.mlp.register_forward_hook(keep),
            module.post_attention_layernorm.register_forward_pre_hook(norm),
        ]
    generator = torch.Generator().manual_seed(0)
    for batch in batches:
        ids = batch["input_ids"]
        logits = model(input_ids=ids).logits[:, :-1].reshape(-1, model.config.vocab_size).float()
        targets = ids[:, 1:].reshape(-1)
        if sampled:
            targets = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=generator).squeeze(1)
        F.cross_entropy(logits, targets, reduction="sum").backward()
    for handle in handles:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return ({layer: torch.cat(values[layer]) for layer in layers} for values in (grads, inputs, residual))


def lowest(score: torch.Tensor, count: int) -> list[int]:
    return sorted(sorted(range(score.numel()), key=lambda e: (float(score[e]), e))[:count])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-moe")
    parser.add_argument("--calib", default="builtin:prose,builtin:code")
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--code-tokens", type=int, default=32768)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    quiet_transformers()
    model_dir = resolve_model(args.model)
    adapter = load_adapter(model_dir)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, adapter)
    num_experts, top_k = model.config.num_experts, adapter.top_k
    masked = MaskedModel(model, num_experts)
    held_out = {
        name: consecutive_windows(
            tokenize_documents(load_documents(source, default_part="heldout"), tokenizer), 256, limit
        ).input_ids
        for name, source, limit in (
            ("prose", "builtin:prose:heldout", None),
            ("code", "builtin:code:heldout", args.code_tokens),
        )
    }

    batches, tags, tag_names = calibration_batches(adapter, model_dir, args.calib, args.calib_tokens, 256, 8, 0, 224)
    sweep = CalibrationSweep(model_dir, batches, tags, tag_names, moe_in_compute_dtype=True, progress=False)
    layers = {}
    for capture in sweep.run(None, label="capture"):
        stats = layer_expert_stats(adapter, capture.moe, capture.moe_input)
        layers[capture.layer] = {"moe": capture.moe, "x": capture.moe_input.float().clone(), "stats": stats}
    grads, inputs, residual = block_gradients(model, batches, list(layers), sampled=False)
    sampled_grads, _, _ = block_gradients(model, batches, list(layers), sampled=True)
    for layer, entry in layers.items():
        if not torch.equal(inputs[layer], entry["x"]):
            raise RuntimeError(f"layer {layer}: the loaded model's block inputs differ from the sweep's")
        entry["g"] = grads[layer]
    for parameter in model.parameters():
        parameter.requires_grad_(False)

    eye = torch.eye(num_experts, dtype=torch.bool)
    scores: dict[str, dict[int, torch.Tensor]] = {}
    for layer, entry in layers.items():
        moe, x, stats, g = entry["moe"], entry["x"], entry["stats"], entry["g"]
        full = adapter.moe_forward(moe, x)
        delta = torch.stack([full - adapter.moe_forward(moe, x, allowed=~eye[e]) for e in range(num_experts)], 1)
        squared = stats.delta_h.double() ** 2
        along = torch.einsum("th,teh->te", g, delta).double()
        weight = g.pow(2).mean(-1).double()[:, None]
        candidates = {
            "frequency": stats.frequency,
            "reap": stats.reap,
            "maep": squared.mean(0),
            "maep fisher": (weight * squared).mean(0),
            "maep fisher (sampled labels)": (sampled_grads[layer].pow(2).mean(-1).double()[:, None] * squared).mean(0),
            "maep directional fisher": along.pow(2).mean(0),
            "maep / |H|^2": (squared / stats.output_norm.double().pow(2).clamp_min(1e-12)[:, None]).mean(0),
            "maep / |residual|^2": (squared / residual[layer].double().pow(2)[:, None]).mean(0),
            "first-order loss change": (-along).mean(0),
        }
        for name, value in candidates.items():
            scores.setdefault(name, {})[layer] = value

    calibration_windows = torch.cat([batch["input_ids"] for batch in batches])
    base = masked.nll(calibration_windows)
    scores["single-removal calibration loss"] = {}
    for layer in layers:
        increase = []
        for e in range(num_experts):
            masked.remove({layer: [e]})
            increase.append(masked.nll(calibration_windows) - base)
        scores["single-removal calibration loss"][layer] = torch.tensor(increase)
    masked.remove({})

    def greedy(layer: int, weighted: bool) -> list[int]:
        entry, removed, order = layers[layer], torch.zeros(num_experts, dtype=torch.bool), []
        factor = entry["g"].pow(2).mean(-1).double()[:, None] if weighted else 1.0
        stats = entry["stats"]
        while num_experts - len(order) > top_k:
            score = (factor * stats.delta_h.double() ** 2).mean(0)
            expert = min((float(score[e]), e) for e in range(num_experts) if not removed[e])[1]
            order.append(expert)
            removed[expert] = True
            stats = layer_expert_stats(adapter, entry["moe"], entry["x"], removed=removed)
        return order

    def best_joint(layer: int, count: int, directional: bool) -> list[int]:
        entry = layers[layer]
        full = adapter.moe_forward(entry["moe"], entry["x"])
        best = None
        for subset in itertools.combinations(range(num_experts), count):
            allowed = torch.ones(num_experts, dtype=torch.bool)
            allowed[list(subset)] = False
            delta = full - adapter.moe_forward(entry["moe"], entry["x"], allowed=allowed)
            value = torch.einsum("th,th->t", entry["g"], delta) if directional else delta.norm(dim=-1)
            value = float(value.pow(2).mean())
            best = min(best or (value, list(subset)), (value, list(subset)))
        return best[1]

    orders = {
        name: {layer: greedy(layer, weighted) for layer in layers}
        for name, weighted in (("maep greedy", False), ("maep fisher greedy", True))
    }
    baseline = {name: math.exp(masked.nll(windows)) for name, windows in held_out.items()}
    rows = []
    for ratio in (0.25, 0.5):
        count = round(ratio * num_experts)
        selections = {name: {layer: lowest(s[layer], count) for layer in layers} for name, s in scores.items()}
        selections.update({name: {layer: sorted(o[layer][:count]) for layer in layers} for name, o in orders.items()})
        if math.comb(num_experts, count) <= 256:
            for name, directional in (("best joint |dH|^2", False), ("best joint (g.dH)^2", True)):
                selections[name] = {layer: best_joint(layer, count, directional) for layer in layers}
        for name, removed in selections.items():
            masked.remove(removed)
            result = {domain: math.exp(masked.nll(windows)) for domain, windows in held_out.items()}
            masked.remove({})
            rows.append({"score": name, "ratio": ratio, "removed": removed, **result})
            print(
                f"{ratio:.2f} {name:32s} prose {result['prose']:8.2f} code {result['code']:8.2f} {removed}", flush=True
            )
    results = {"model": args.model, "calibration": args.calib, "tokens": int(tags.numel()), "baseline": baseline}
    results["rows"] = rows
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
