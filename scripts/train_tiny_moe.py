"""Train the built-in ``tiny-moe`` checkpoint (``builtin:tiny-moe``) from scratch on the built-in corpus.

The result is a real, if small, Qwen3-MoE causal LM (by default 4 layers, 8 experts, top-2 routing) with its own
byte-level BPE tokenizer, trained on the calibration part of the stdlib prose and code documents. It is small enough to
commit and to compress in seconds on a CPU, yet trained enough that perplexity, routing statistics and the damage
done by compression are meaningful. The held-out part of the corpus is never trained on; the script reports the
held-out perplexity of the saved bfloat16 checkpoint in ``training_info.json``.

The load-balancing loss is taken per layer: the one built into transformers pools all layers, which lets a single
layer keep dead experts. Prose is a quarter of each batch by default: its calibration part is only ~110k tokens,
and at half of each batch the model memorises it (held-out prose perplexity turns upward after ~500 steps). With
``--minutes`` the cosine decay follows the wall clock, so a slow or shared machine still ends annealed within the
budget; ``--steps`` uses a step-based schedule instead, which repeats bit for bit.

    python scripts/train_tiny_moe.py                      # ~13 minutes on 2 CPU cores
    python scripts/train_tiny_moe.py --minutes 0.5 --out /tmp/tiny-smoke
    python scripts/train_tiny_moe.py --steps 1800 --num-experts 64 --top-k 8 --moe-intermediate-size 32 \
        --out DIR                                         # docs/qat.md's fine-grained model, ~15 minutes
    python scripts/train_tiny_moe.py --minutes 45 --hidden-size 256 --num-heads 4 --num-kv-heads 2 --head-dim 64 \
        --num-experts 16 --top-k 4 --no-tie-embeddings --out DIR   # docs/llama_cpp.md's model: every width 256
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from moecompress.calibration.builtin_corpus import builtin_documents

SOURCES = ("prose", "code")
EOS = "<|endoftext|>"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="moecompress/assets/tiny-moe")
    parser.add_argument("--minutes", type=float, default=12.0, help="wall-clock budget for the training loop")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="fixed number of steps (step-based schedule) instead of --minutes",
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--prose-fraction", type=float, default=0.25, help="share of each batch drawn from prose (the rest is code)"
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=40)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--moe-intermediate-size", type=int, default=256)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=8, help="attention heads (query)")
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument(
        "--tie-embeddings",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the input embeddings with the output head (--no-tie-embeddings: a head of its own)",
    )
    parser.add_argument("--num-layers", type=int, default=4, help="decoder layers, every one an MoE layer")
    parser.add_argument("--num-experts", type=int, default=8, help="routed experts per layer")
    parser.add_argument("--top-k", type=int, default=2, help="experts each token is routed to")
    parser.add_argument("--aux-loss-coef", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--eval-every", type=int, default=0, help="print held-out perplexity every N steps")
    return parser.parse_args()


def document_texts(source: str, part: str) -> list[str]:
    return [doc.text + "\n\n" for doc in builtin_documents(source, part)]


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS,
        pad_token=EOS,
        bos_token=EOS,
        unk_token=None,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
    return torch.tensor(ids, dtype=torch.long)


def build_config(tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=256,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=args.tie_embeddings,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate_size,
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=args.aux_loss_coef,
        use_cache=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def sample_batch(
    streams: dict[str, torch.Tensor], counts: dict[str, int], seq_len: int, gen: torch.Generator
) -> torch.Tensor:
    windows = []
    for source, count in counts.items():
        stream = streams[source]
        starts = torch.randint(0, len(stream) - seq_len + 1, (count,), generator=gen)
        windows.extend(stream[s : s + seq_len] for s in starts.tolist())
    return torch.stack(windows)


def balance_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> torch.Tensor:
    per_layer = [load_balancing_loss_func((logits,), num_experts, top_k) for logits in router_logits]
    return torch.stack(per_layer).mean()


def min_expert_share(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> float:
    shares = []
    for logits in router_logits:
        chosen = logits.topk(top_k, dim=-1).indices.flatten()
        shares.append(torch.bincount(chosen, minlength=num_experts).min().item() / chosen.numel())
    return min(shares)


def lr_at(step: int, progress: float, args: argparse.Namespace) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    ratio = args.min_lr_ratio + (1.0 - args.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.lr * ratio


@torch.no_grad()
def heldout_perplexity(model: torch.nn.Module, stream: torch.Tensor, seq_len: int, batch_size: int = 16) -> float:
    model.eval()
    n_windows = len(stream) // seq_len
    windows = stream[: n_windows * seq_len].view(n_windows, seq_len)
    total_nll, total_tokens = 0.0, 0
    for i in range(0, n_windows, batch_size):
        batch = windows[i : i + batch_size]
        logits = model(input_ids=batch, use_cache=False).logits.float()
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_tokens += batch[:, 1:].numel()
    return math.exp(total_nll / total_tokens)


def main() -> None:
    args = parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    t0 = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    calib = {source: document_texts(source, "calib") for source in SOURCES}
    heldout = {source: document_texts(source, "heldout") for source in SOURCES}
    tokenizer = train_tokenizer(calib["prose"] + calib["code"], args.vocab_size)
    streams = {source: encode_stream(tokenizer, calib[source]) for source in SOURCES}
    heldout_streams = {source: encode_stream(tokenizer, heldout[source]) for source in SOURCES}
    print(
        f"tokenizer: vocab {len(tokenizer)}; calib tokens "
        + ", ".join(f"{s} {len(streams[s]):,}" for s in SOURCES)
        + "; heldout tokens "
        + ", ".join(f"{s} {len(heldout_streams[s]):,}" for s in SOURCES)
        + f" ({time.time() - t0:.1f}s)",
    )

    config = build_config(tokenizer, args)
    model = Qwen3MoeForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "gate.weight" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "gate.weight" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    n_prose = round(args.batch_size * args.prose_fraction)
    counts = {"prose": n_prose, "code": args.batch_size - n_prose}
    gen = torch.Generator().manual_seed(args.seed)
    budget_s = args.minutes * 60.0
    train_start, eval_seconds, warmup_end = time.time(), 0.0, 0.0
    step, loss_ema, lm_loss = 0, None, float("nan")
    model.train()
    while True:
        elapsed = time.time() - train_start - eval_seconds
        if step == args.warmup_steps:
            warmup_end = elapsed
        if args.steps is not None:
            progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
        else:
            progress = (elapsed - warmup_end) / max(1e-9, budget_s - warmup_end)
        if (step >= args.steps) if args.steps is not None else elapsed >= budget_s:
            break
        lr = lr_at(step, min(1.0, progress), args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_batch(streams, counts, args.seq_len, gen)
        out = model(input_ids=batch, output_router_logits=True, use_cache=False)
        loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        aux = balance_loss(out.router_logits, config.num_experts, config.num_experts_per_tok)
        optimizer.zero_grad(set_to_none=True)
        (loss + config.router_aux_loss_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        lm_loss = loss.item()
        loss_ema = lm_loss if loss_ema is None else 0.9 * loss_ema + 0.1 * lm_loss
        step += 1
        if step % args.log_every == 0 or step == 1:
            print(
                f"step {step:5d} | loss {lm_loss:.4f} (ema {loss_ema:.4f}) | aux {aux.item():.4f} | min expert share "
                f"{min_expert_share(out.router_logits, config.num_experts, config.num_experts_per_tok):.3f} "
                f"| lr {lr:.2e} | {time.time() - train_start - eval_seconds:6.1f}s",
            )
        if args.eval_every and step % args.eval_every == 0:
            eval_start = time.time()
            ppl = {source: heldout_perplexity(model, heldout_streams[source], args.seq_len) for source in SOURCES}
            print(
                f"step {step:5d} | heldout perplexity prose {ppl['prose']:.2f} | code {ppl['code']:.2f}",
            )
            model.train()
            eval_seconds += time.time() - eval_start
    train_minutes = (time.time() - train_start - eval_seconds) / 60.0
    tokens_seen = step * args.batch_size * args.seq_len
    print(f"trained {step} steps, {tokens_seen:,} tokens in {train_minutes:.2f} min")

    out_dir = os.path.abspath(args.out)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    fp32_ppl = {source: heldout_perplexity(model, heldout_streams[source], args.seq_len) for source in SOURCES}
    print(f"heldout perplexity (fp32 weights): prose {fp32_ppl['prose']:.2f} | code {fp32_ppl['code']:.2f}")
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}-tmp-", dir=parent)
    try:
        model.eval()
        model.to(torch.bfloat16).save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_dir, dtype=torch.float32)
        ppl = {source: heldout_perplexity(reloaded, heldout_streams[source], args.seq_len) for source in SOURCES}
        print(f"heldout perplexity (bf16 checkpoint, fp32 eval): prose {ppl['prose']:.2f} | code {ppl['code']:.2f}")
        info = {
            "seed": args.seed,
            "steps": step,
            "schedule": "steps" if args.steps is not None else "wall-clock",
            "tokens_seen": tokens_seen,
            "train_wall_minutes": round(train_minutes, 3),
            "final_train_loss": round(loss_ema if loss_ema is not None else lm_loss, 4),
            "final_train_loss_last_step": round(lm_loss, 4),
            "heldout_perplexity": {source: round(value, 3) for source, value in ppl.items()},
            "heldout_perplexity_fp32_before_save": {source: round(v, 3) for source, v in fp32_ppl.items()},
            "heldout_tokens": {source: len(heldout_streams[source]) for source in SOURCES},
            "calib_tokens": {source: len(streams[source]) for source in SOURCES},
            "parameters": n_params,
            "hyperparameters": {
                k: getattr(args, k.replace("-", "_"))
                for k in (
                    "batch-size",
                    "prose-fraction",
                    "seq-len",
                    "lr",
                    "min-lr-ratio",
                    "warmup-steps",
                    "weight-decay",
                    "vocab-size",
                    "moe-intermediate-size",
                    "num-layers",
                    "num-experts",
                    "top-k",
                    "hidden-size",
                    "num-heads",
                    "num-kv-heads",
                    "head-dim",
                    "tie-embeddings",
                )
            },
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        }
        with open(os.path.join(tmp_dir, "training_info.json"), "w") as handle:
            json.dump(info, handle, indent=2)
            handle.write("\n")
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        for name in os.listdir(tmp_dir):
            os.chmod(os.path.join(tmp_dir, name), 0o644)
        os.chmod(tmp_dir, 0o755)
        os.rename(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    print(f"saved to {out_dir} ({time.time() - t0:.1f}s total)")


if __name__ == "__main__":
    main()
