"""A multiple-choice check: rank given continuations of held-out text by their log-likelihood.

REAP's paper separates generation from multiple-choice tasks (pruning keeps the first better, merging the second);
this is a small stand-in for the multiple-choice side that needs no downloaded benchmark. Each item is a context of
C tokens of the held-out token stream, its true next L tokens, and D distractors: L-token spans drawn (seeded) from
other places of the same stream, never overlapping the item's own C + L tokens. Items start at evenly spaced,
non-overlapping places over the whole stream.

Every continuation is scored by its summed log-likelihood given the context. All continuations are L tokens long,
so the summed and the length-normalised scores rank alike. Accuracy is the share of items whose true continuation
scores strictly highest; the margin is the true continuation's score minus the best distractor's, in nats per
continuation token, averaged over items. The context runs once and its key/value cache serves all of an item's
continuations (the scores of running each context + continuation whole, at less than half the compute).
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..calibration.batches import tokenize_documents
from ..calibration.sources import load_documents
from ..checkpoint.stock_model import stock_config
from ..device import compute_device
from ..errors import UserInputError
from ..loading import load_adapter, load_model, load_tokenizer
from ..progress import bar as progress_bar
from .perplexity import moe_token_bytes

DEFAULT_CONTEXT = 64
DEFAULT_LENGTH = 16
DEFAULT_ITEMS = 256
DEFAULT_DISTRACTORS = 3


@dataclass
class ChoiceItems:
    """``contexts[N, C]`` and ``continuations[N, 1 + D, L]``, the true continuation first."""

    contexts: torch.Tensor
    continuations: torch.Tensor


@dataclass
class ChoiceResult:
    accuracy: float
    margin: float
    items: int
    context: int
    length: int
    distractors: int

    def to_json(self) -> dict:
        return asdict(self)


def build_items(
    ids: torch.Tensor,
    *,
    context: int = DEFAULT_CONTEXT,
    length: int = DEFAULT_LENGTH,
    items: int = DEFAULT_ITEMS,
    distractors: int = DEFAULT_DISTRACTORS,
    seed: int = 0,
) -> ChoiceItems:
    """The items of a 1-D token stream (see the module docstring)."""
    if min(context, length, items, distractors) < 1:
        raise UserInputError("the multiple-choice check needs context, length, items and distractors of at least 1")
    span = context + length
    stride = len(ids) // items
    if stride < span:
        raise UserInputError(
            f"the data holds {len(ids)} tokens, too few for {items} items of {span} tokens without overlap"
        )
    generator = torch.Generator().manual_seed(seed)
    contexts, continuations = [], []
    for start in range(0, items * stride, stride):
        chosen = [ids[start + context : start + span]]
        for _ in range(100 * distractors):
            place = int(torch.randint(0, len(ids) - length + 1, (1,), generator=generator))
            candidate = ids[place : place + length]
            if not start - length < place < start + span and not any(torch.equal(candidate, c) for c in chosen):
                chosen.append(candidate)
                if len(chosen) == 1 + distractors:
                    break
        else:
            raise UserInputError(f"the data holds too few distinct {length}-token spans for {distractors} distractors")
        contexts.append(ids[start : start + context])
        continuations.append(torch.stack(chosen))
    return ChoiceItems(contexts=torch.stack(contexts), continuations=torch.stack(continuations))


def _accepts(model: torch.nn.Module, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def _token_log_likelihoods(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    log_probs = F.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, targets[..., None].to(log_probs.device)).squeeze(-1).cpu()


def _score_whole(model: torch.nn.Module, contexts: torch.Tensor, continuations: torch.Tensor) -> torch.Tensor:
    """Each context + continuation run as one sequence."""
    count, choices, length = continuations.shape
    sequences = torch.cat([contexts[:, None, :].expand(-1, choices, -1), continuations], dim=-1)
    sequences = sequences.reshape(count * choices, -1).to(model.device)
    keep = {"logits_to_keep": length + 1} if _accepts(model, "logits_to_keep") else {}
    logits = model(input_ids=sequences, use_cache=False, **keep).logits[:, -(length + 1) : -1]
    return _token_log_likelihoods(logits, sequences[:, -length:]).sum(-1).view(count, choices)


def _score_shared(model: torch.nn.Module, contexts: torch.Tensor, continuations: torch.Tensor) -> torch.Tensor | None:
    """The context run once, its key/value cache repeated for each continuation (the same scores, less compute);
    None where the model's cache cannot be repeated along the batch."""
    count, choices, length = continuations.shape
    keep = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
    out = model(input_ids=contexts.to(model.device), use_cache=True, **keep)
    cache_name = "cache" if _accepts(model, "cache") else "past_key_values"  # transformers renamed it
    cache = getattr(out, cache_name, None)
    if cache is None or not hasattr(cache, "batch_repeat_interleave"):
        return None
    cache.batch_repeat_interleave(choices)
    flat = continuations.reshape(count * choices, length).to(model.device)
    logits = out.logits[:, -1:].repeat_interleave(choices, dim=0)
    if length > 1:
        rest = model(input_ids=flat[:, :-1], use_cache=True, **{cache_name: cache}).logits
        logits = torch.cat([logits, rest], dim=1)
    return _token_log_likelihoods(logits, flat).sum(-1).view(count, choices)


def score_items(
    model: torch.nn.Module,
    items: ChoiceItems,
    *,
    items_per_forward: int = 16,
    share_context: bool = True,
    progress: bool = False,
) -> torch.Tensor:
    """``[N, 1 + D]`` summed log-likelihoods of every continuation given its item's context."""
    scores = []
    batches = range(0, items.contexts.shape[0], items_per_forward)
    with torch.inference_mode():
        for start in progress_bar(batches, desc="choice", unit="batch", disable=not progress):
            contexts = items.contexts[start : start + items_per_forward]
            continuations = items.continuations[start : start + items_per_forward]
            batch = _score_shared(model, contexts, continuations) if share_context else None
            scores.append(batch if batch is not None else _score_whole(model, contexts, continuations))
    return torch.cat(scores)


def summarize(scores: torch.Tensor, length: int) -> tuple[float, float]:
    """(accuracy, mean margin in nats per continuation token) of ``[N, 1 + D]`` scores, the true one first."""
    best_distractor = scores[:, 1:].max(dim=-1).values
    accuracy = (scores[:, 0] > best_distractor).float().mean().item()
    margin = ((scores[:, 0] - best_distractor) / length).mean().item()
    return accuracy, margin


def items_per_forward(tokens_per_item: int, token_bytes: int) -> int:
    """Items per forward so that an MoE layer's expert computation stays near 256 MB (as in perplexity)."""
    if not token_bytes:
        return 16
    return max(1, min(16, (256 * 2**20) // (tokens_per_item * token_bytes)))


def choice_items(
    model_dir: Path,
    data: str,
    *,
    context: int = DEFAULT_CONTEXT,
    length: int = DEFAULT_LENGTH,
    items: int = DEFAULT_ITEMS,
    distractors: int = DEFAULT_DISTRACTORS,
    seed: int = 0,
) -> ChoiceItems:
    """The items of ``data`` (its held-out part unless it names a part) in ``model_dir``'s tokens."""
    adapter = load_adapter(model_dir)
    stock_config(model_dir, adapter)  # the tokenizer reads config.json through transformers too
    stream = tokenize_documents(load_documents(data, default_part="heldout"), load_tokenizer(model_dir))
    return build_items(stream.ids, context=context, length=length, items=items, distractors=distractors, seed=seed)


def evaluate_items(model_dir: Path, item_sets: list[ChoiceItems], progress: bool = False) -> list[ChoiceResult]:
    """Score every item set with the whole model, loaded once like :func:`~.perplexity.evaluate` loads it."""
    adapter = load_adapter(model_dir)
    device = compute_device()
    model = load_model(model_dir, adapter, device_map={"": str(device)} if device.type != "cpu" else None)
    results = []
    for items in item_sets:
        count, choices, length = items.continuations.shape
        context = items.contexts.shape[1]
        per_forward = items_per_forward(choices * (context + length), moe_token_bytes(adapter))
        scores = score_items(model, items, items_per_forward=per_forward, progress=progress)
        accuracy, margin = summarize(scores, length)
        results.append(
            ChoiceResult(
                accuracy=accuracy,
                margin=margin,
                items=count,
                context=context,
                length=length,
                distractors=choices - 1,
            )
        )
    return results


def evaluate_choice(
    model_dir: Path,
    data: str,
    *,
    context: int = DEFAULT_CONTEXT,
    length: int = DEFAULT_LENGTH,
    items: int = DEFAULT_ITEMS,
    distractors: int = DEFAULT_DISTRACTORS,
    seed: int = 0,
    progress: bool = False,
) -> ChoiceResult:
    """The check on ``data`` with ``model_dir``'s own tokenizer and model."""
    built = choice_items(
        model_dir, data, context=context, length=length, items=items, distractors=distractors, seed=seed
    )
    return evaluate_items(model_dir, [built], progress=progress)[0]
