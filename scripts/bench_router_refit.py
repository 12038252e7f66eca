"""Router recalibration on real MoE inputs: relative error of each layer's routed output before and after the refit.

Captures every MoE layer's inputs of a checkpoint (default ``builtin:tiny-moe``) on the calibration prose and on
held-out prose, removes the experts with the lowest REAP score (``reap``) or merges them into as many groups
(``merge``, :mod:`moecompress.passes.expert_merge`) (25% and 50% per layer), refits the surviving router rows on the
calibration tokens (:func:`moecompress.passes.router_refit.recalibrate_router`) for each learning rate
given, and prints per layer the relative error ‖Δ‖²/‖ref‖² on the calibration and held-out tokens before and after,
the error after every ``--eval-every`` steps, and the refit's seconds beside those of one forward of the layer over
the calibration tokens (measured in the same run). ``--constant-outputs`` also prints the error where the removed
experts stay in the routing and output a constant instead (MoNe-style; no family's stored layout holds that).

``--scale`` instead measures the peak memory of one refit of a seeded random Qwen3-MoE-shaped layer (128 experts,
top-8, hidden 2048, narrow experts so that it runs on a CPU in minutes) on 16,384 random tokens: the process's peak
resident memory above what it held before, against the size of the tokens themselves.

Run: OMP_NUM_THREADS=1 python scripts/bench_router_refit.py [--model builtin:tiny-moe] [--lr 1e-3 3e-3 1e-2]
     OMP_NUM_THREADS=1 python scripts/bench_router_refit.py --scale [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moecompress.calibration.model_inputs import calibration_batches
from moecompress.checkpoint.resolve import resolve_model
from moecompress.loading import load_adapter
from moecompress.passes.expert_scores import layer_expert_stats
from moecompress.passes.router_refit import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_EVAL_EVERY,
    DEFAULT_LR,
    DEFAULT_STEPS,
    recalibrate_router,
)
from moecompress.sweep.engine import CalibrationSweep


def captures(model_dir: Path, source: str, tokens: int, seq_len: int) -> dict[int, tuple]:
    """``{layer: (moe, moe_input, router_input)}`` of every MoE layer, swept with the original weights."""
    adapter = load_adapter(model_dir)
    batches, tags, names = calibration_batches(adapter, model_dir, source, tokens, seq_len, 8, 0, 224)
    sweep = CalibrationSweep(model_dir, batches, tags, names, moe_in_compute_dtype=True, progress=False)
    return {c.layer: (c.moe, c.moe_input, c.router_input) for c in sweep.run()}


def relative_error(adapter, reference, compressed, hidden, router_input) -> float:
    with torch.no_grad():
        ref = adapter.moe_forward(reference, hidden.float(), router_input=router_input)
        out = adapter.moe_forward(compressed, hidden.float(), router_input=router_input)
    return float((out - ref).double().pow(2).sum() / ref.double().pow(2).sum())


def constant_outputs_error(adapter, moe, keep, hidden, router_input, held_hidden, held_router) -> tuple[float, float]:
    """MoNe-style: the removed experts stay in the routing but output a constant, their mean output over the
    calibration tokens routed to them (unscaled tokens, also where the rule scales expert inputs). The relative error
    on the calibration and held-out tokens."""
    removed = [e for e in range(moe.num_experts) if e not in keep]
    with torch.no_grad():
        ids, _ = adapter.route(
            moe, adapter.router_logits(moe, hidden.float() if router_input is None else router_input)
        )
        constant = {}
        for e in removed:
            tokens = (ids == e).any(dim=1)
            routed = hidden.float()[tokens]
            constant[e] = adapter.expert_output(moe, e, routed).mean(dim=0) if routed.shape[0] else None

    def error(x, routed_by):
        with torch.no_grad():
            ref = adapter.moe_forward(moe, x.float(), router_input=routed_by)
            r_ids, r_weights = adapter.route(
                moe, adapter.router_logits(moe, x.float() if routed_by is None else routed_by)
            )

            def output_of(expert, expert_input):
                if expert not in constant:
                    return adapter.expert_output(moe, expert, expert_input)
                value = constant[expert]
                return None if value is None else value.expand(expert_input.shape[0], -1)

            out = adapter.combine_experts(x.float(), r_ids, r_weights, output_of)
        return float((out - ref).double().pow(2).sum() / ref.double().pow(2).sum())

    return error(hidden, router_input), error(held_hidden, held_router)


def scale(steps: int, batch_tokens: int) -> None:
    import resource

    from moecompress.families import MoEWeights, adapter_for

    experts, hidden_size, inter, tokens = 128, 2048, 64, 16384
    adapter = adapter_for(
        {
            "model_type": "qwen3_moe",
            "num_experts": experts,
            "num_experts_per_tok": 8,
            "hidden_size": hidden_size,
            "num_hidden_layers": 1,
            "norm_topk_prob": True,
            "num_attention_heads": 32,
        }
    )
    generator = torch.Generator().manual_seed(0)
    moe = MoEWeights(
        router_weight=torch.randn(experts, hidden_size, generator=generator) * 0.02,
        gate_up=torch.randn(experts, 2 * inter, hidden_size, generator=generator) * 0.02,
        down=torch.randn(experts, hidden_size, inter, generator=generator) * 0.02,
        expert_ids=list(range(experts)),
    )
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    pruned = moe.select(list(range(0, experts, 2)))
    held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    start, cpu = time.perf_counter(), time.process_time()
    _, report = recalibrate_router(adapter, moe, pruned, hidden, steps=steps, batch_tokens=batch_tokens)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    size = hidden.numel() * 4 / 2**30
    print(
        f"{experts} experts (64 removed), hidden {hidden_size}, {tokens} tokens, {steps} steps: peak RSS "
        f"{held:.2f} GiB before, {peak:.2f} GiB during (+{peak - held:.2f} GiB; the tokens are {size:.3f} GiB), "
        f"{seconds:.1f} s wall, {cpu:.1f} s CPU; error {report['error_before']:.4f} -> {report['error_after']:.4f}"
    )


def compress(adapter, moe, hidden, router_input, method: str, removed: int):
    """The layer with ``removed`` experts fewer: the lowest-REAP ones removed, or all merged into fewer groups."""
    if method == "reap":
        reap = layer_expert_stats(adapter, moe, hidden, router_input=router_input).reap
        order = sorted(range(moe.num_experts), key=lambda e: (float(reap[e]), e))
        return moe.select(sorted(order[removed:]))
    from moecompress.passes.expert_merge import cut_tree, expert_signatures, merge_experts, merge_tree

    signatures = expert_signatures(adapter, moe, hidden, router_input)
    groups = cut_tree(merge_tree(signatures), moe.num_experts, moe.num_experts - removed)
    return merge_experts(adapter, moe, groups, hidden, router_input)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-moe")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--methods", nargs="+", choices=["reap", "merge"], default=["reap", "merge"])
    parser.add_argument("--lr", type=float, nargs="+", default=[DEFAULT_LR])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS)
    parser.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--constant-outputs", action="store_true", help="also: removed experts routed as before, output a constant"
    )
    parser.add_argument("--scale", action="store_true", help="measure the peak memory at Qwen3-30B-A3B's router shape")
    args = parser.parse_args()
    if args.scale:
        scale(args.steps, args.batch_tokens)
        return
    model_dir = resolve_model(args.model)
    adapter = load_adapter(model_dir)
    calib = captures(model_dir, "builtin:prose", args.tokens, args.seq_len)
    heldout = captures(model_dir, "builtin:prose:heldout", args.tokens, args.seq_len)
    rows = []
    for layer, (moe, hidden, router_input) in calib.items():
        start = time.perf_counter()
        with torch.no_grad():
            adapter.moe_forward(moe, hidden.float(), router_input=router_input)
        forward = time.perf_counter() - start
        _, held_hidden, held_router = heldout[layer]
        for method, ratio in [(method, ratio) for ratio in args.ratios for method in args.methods]:
            removed = round(moe.num_experts * ratio)
            compressed = compress(adapter, moe, hidden, router_input, method, removed)
            if method == "reap" and args.constant_outputs:
                keep = [moe.expert_ids.index(i) for i in compressed.expert_ids]
                calib_error, held_error = constant_outputs_error(
                    adapter, moe, keep, hidden, router_input, held_hidden, held_router
                )
                print(
                    f"layer {layer} reap {removed}/{moe.num_experts} constant outputs (MoNe-style): calib "
                    f"{calib_error:.4f}, held-out {held_error:.4f}",
                    flush=True,
                )
            for lr in args.lr:
                start = time.perf_counter()
                refit, report = recalibrate_router(
                    adapter,
                    moe,
                    compressed,
                    hidden,
                    router_input,
                    steps=args.steps,
                    lr=lr,
                    batch_tokens=args.batch_tokens,
                    eval_every=args.eval_every,
                )
                seconds = time.perf_counter() - start
                row = {
                    "layer": layer,
                    "method": method,
                    "removed": removed,
                    "lr": lr,
                    "calib_before": report["error_before"],
                    "calib_after": report["error_after"],
                    "heldout_before": relative_error(adapter, moe, compressed, held_hidden, held_router),
                    "heldout_after": relative_error(adapter, moe, refit, held_hidden, held_router),
                    "best_step": report["best_step"],
                    "seconds": seconds,
                    "forward_seconds": forward,
                    "history": [[s, round(e, 5)] for s, e in report["history"]],
                }
                rows.append(row)
                print(
                    f"layer {layer} {method} {removed}/{moe.num_experts} lr {lr:g}: calib {row['calib_before']:.4f} -> "
                    f"{row['calib_after']:.4f}, held-out {row['heldout_before']:.4f} -> {row['heldout_after']:.4f}, "
                    f"best step {row['best_step']}, {seconds:.2f} s ({seconds / forward:.0f}x one forward of the "
                    f"layer, {forward:.3f} s); history {row['history']}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
