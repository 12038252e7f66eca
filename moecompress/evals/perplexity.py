"""Perplexity, KL to a reference model and routing agreement over consecutive windows of a source.

Perplexity is ``exp(mean NLL)`` over every predicted token (positions 1..L-1 of each window). KL is the mean over
those tokens of KL(reference ‖ model) of the next-token distributions. Routing agreement is the mean over MoE
layers and tokens of |S_ref ∩ S| / k, with pruned models' expert ids mapped back to the original ids.

An encoder-decoder (Switch Transformers) is evaluated on T5's span corruption of the windows at a fixed seed
(:data:`SEQ2SEQ_SEED`, so a model and its reference see the same spans): the perplexity of the decoder's targets
(every position of the labels, EOS included) given the corrupted source.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..calibration.batches import TokenWindows, consecutive_windows, tokenize_documents
from ..calibration.sources import load_documents
from ..calibration.span_corruption import TARGETS, Seq2SeqWindows, model_inputs, seq2seq_windows
from ..checkpoint.stock_model import stock_config
from ..defaults import DEFAULT_SEQ_LEN
from ..device import compute_device
from ..errors import UserInputError
from ..families import FamilyAdapter
from ..loading import load_adapter, load_model, load_tokenizer
from ..progress import bar as progress_bar
from ..progress import event
from .routing import RouteRecorder, routing_agreement


@dataclass
class EvalResult:
    perplexity: float
    tokens: int
    tokens_per_second: float
    seq_len: int
    windows: int
    kl: float | None = None
    routing_agreement: float | None = None
    reference_perplexity: float | None = None

    def to_json(self, with_speed: bool = False) -> dict:
        """The figures as JSON; the speed (a wall-clock figure) only when asked, so that a report written into a
        checkpoint is the same on every rerun."""
        return {
            key: value
            for key, value in asdict(self).items()
            if value is not None and (with_speed or key != "tokens_per_second")
        }


@dataclass
class BatchSums:
    """One batch's contribution: summed NLL, predicted tokens, summed KL(reference ‖ model), reference NLL."""

    nll: float
    predicted: int
    kl: float = 0.0
    ref_nll: float = 0.0


SEQ2SEQ_SEED = 0


def batch_sums(input_ids: torch.Tensor, logits: torch.Tensor, ref_logits: torch.Tensor | None = None) -> BatchSums:
    """The sums of one batch of windows from its logits ``[B, L, V]`` (and the reference's)."""
    return target_sums(input_ids[:, 1:], logits[:, :-1], None if ref_logits is None else ref_logits[:, :-1])


def window_sums(batch: dict[str, torch.Tensor], logits: torch.Tensor, ref_logits: torch.Tensor | None) -> BatchSums:
    """The sums of one of :func:`forward_batches`' batches."""
    if TARGETS in batch:
        return target_sums(batch[TARGETS], logits, ref_logits)
    return batch_sums(batch["input_ids"], logits, ref_logits)


def target_sums(targets: torch.Tensor, logits: torch.Tensor, ref_logits: torch.Tensor | None = None) -> BatchSums:
    """The sums of ``logits`` ``[B, L, V]`` predicting ``targets`` ``[B, L]`` position by position."""
    targets = targets.to(logits.device)
    log_probs = F.log_softmax(logits.float(), dim=-1)
    sums = BatchSums(nll=-log_probs.gather(-1, targets[..., None]).sum().item(), predicted=targets.numel())
    if ref_logits is not None:
        ref_log_probs = F.log_softmax(ref_logits.float(), dim=-1)
        sums.ref_nll = -ref_log_probs.gather(-1, targets[..., None]).sum().item()
        sums.kl = (ref_log_probs.exp() * (ref_log_probs - log_probs)).sum().item()
    return sums


@dataclass
class EvalTotals:
    """What an evaluation sums over its batches (and, for routing agreement, its MoE layers), and the
    :class:`EvalResult` those sums make; both the whole-model and the streamed evaluation fill one."""

    nll: float = 0.0
    predicted: int = 0
    kl: float = 0.0
    ref_nll: float = 0.0
    agreement: float = 0.0
    agreement_count: int = 0
    model_seconds: float = 0.0

    def add(self, sums: BatchSums) -> None:
        self.nll += sums.nll
        self.predicted += sums.predicted
        self.kl += sums.kl
        self.ref_nll += sums.ref_nll

    def add_agreement(self, total: float, count: int) -> None:
        self.agreement += total
        self.agreement_count += count

    def result(self, windows: TokenWindows | Seq2SeqWindows, with_reference: bool) -> EvalResult:
        return EvalResult(
            perplexity=math.exp(self.nll / self.predicted),
            tokens=self.predicted,
            tokens_per_second=windows.num_tokens / self.model_seconds if self.model_seconds > 0 else float("nan"),
            seq_len=windows.input_ids.shape[1],
            windows=windows.input_ids.shape[0],
            kl=self.kl / self.predicted if with_reference else None,
            routing_agreement=(self.agreement / self.agreement_count if self.agreement_count else None)
            if with_reference
            else None,
            reference_perplexity=math.exp(self.ref_nll / self.predicted) if with_reference else None,
        )


def forward_batches(windows: TokenWindows | Seq2SeqWindows, batch_size: int):
    """``windows`` in batches of ``batch_size`` rows, each the forward's keyword arguments; an encoder-decoder's
    with its labels under ``TARGETS`` (:func:`window_sums`)."""
    if isinstance(windows, TokenWindows):
        for input_ids, _ in windows.batches(batch_size):
            yield {"input_ids": input_ids}
        return
    for at in range(0, windows.input_ids.shape[0], batch_size):
        rows = slice(at, at + batch_size)
        yield {
            "input_ids": windows.input_ids[rows],
            "decoder_input_ids": windows.decoder_input_ids[rows],
            TARGETS: windows.labels[rows],
        }


def moe_token_bytes(adapter: FamilyAdapter) -> int:
    """About what a token costs in an MoE layer's grouped expert computation (transformers' ``grouped_mm``): a
    copy of its hidden state, the projections and the output for each of its top-k experts, in float32."""
    if not adapter.moe_layers():
        return 0
    return adapter.top_k * 5 * int(adapter.text_config["hidden_size"]) * 4


def windows_per_forward(seq_len: int, vocab: int, token_bytes: int = 0) -> int:
    """Windows per forward so that a batch's fp32 logits stay near 256 MB, and its MoE layers' expert computation
    (``token_bytes`` a token) too: 16 windows of 256 tokens of a Qwen3-30B-A3B-shaped layer would need 1.1 GB."""
    limit = (64 * 2**20) // (seq_len * vocab)
    if token_bytes:
        limit = min(limit, (256 * 2**20) // (seq_len * token_bytes))
    return max(1, min(16, limit))


def _head_rows(model: torch.nn.Module) -> int:
    """The output projection's row count; the text config's vocabulary size where the stock class does not expose
    its head (Nemotron 3 Nano Omni's ``language_model.lm_head``)."""
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else int(model.config.get_text_config().vocab_size)


def evaluate_windows(
    model: torch.nn.Module,
    adapter: FamilyAdapter,
    windows: TokenWindows | Seq2SeqWindows,
    reference: tuple[torch.nn.Module, FamilyAdapter] | None = None,
    progress: bool = True,
) -> EvalResult:
    """Evaluate a loaded model on token windows, optionally against a loaded reference model."""
    seq_len = windows.input_ids.shape[1]
    vocab = _head_rows(model)
    if reference is not None:
        ref_vocab = _head_rows(reference[0])
        if ref_vocab != vocab:
            raise UserInputError(f"model and reference vocabularies differ ({vocab} vs {ref_vocab})")
    totals = EvalTotals()
    recorder = RouteRecorder(model, adapter) if reference is not None else None
    ref_recorder = RouteRecorder(*reference) if reference is not None else None
    token_bytes = max(moe_token_bytes(adapter), moe_token_bytes(reference[1]) if reference is not None else 0)
    batch_size = windows_per_forward(seq_len, vocab, token_bytes)
    total_batches = math.ceil(windows.input_ids.shape[0] / batch_size)
    try:
        with torch.inference_mode():
            for batch in progress_bar(
                forward_batches(windows, batch_size),
                total=total_batches,
                desc="eval",
                unit="batch",
                disable=not progress,
            ):
                inputs = model_inputs(batch)
                start = time.perf_counter()
                logits = model(**{k: v.to(model.device) for k, v in inputs.items()}, use_cache=False).logits
                totals.model_seconds += time.perf_counter() - start
                ref_logits = None
                if reference is not None:
                    ref_inputs = {k: v.to(reference[0].device) for k, v in inputs.items()}
                    ref_logits = reference[0](**ref_inputs, use_cache=False).logits
                    ref_logits = ref_logits.to(logits.device)
                totals.add(window_sums(batch, logits, ref_logits))
                if reference is not None:
                    totals.add_agreement(*routing_agreement(ref_recorder.routes, recorder.routes))
                    recorder.clear()
                    ref_recorder.clear()
    finally:
        for rec in (recorder, ref_recorder):
            if rec is not None:
                rec.remove()
    return totals.result(windows, with_reference=reference is not None)


def evaluate(
    model_dir: Path,
    data: str,
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    max_tokens: int | None = None,
    reference_dir: Path | None = None,
    progress: bool = True,
    whole_model: bool = False,
) -> EvalResult:
    """Tokenise ``data`` with ``model_dir``'s tokenizer and evaluate the model (against ``reference_dir``).

    The models run side by side one decoder layer at a time (:mod:`.streamed`); ``whole_model`` loads both whole
    instead (the reference the tests hold the streamed figures to). A checkpoint that cannot be built layer by
    layer is loaded whole, and a line says so."""
    adapter = load_adapter(model_dir)
    ref_adapter = load_adapter(reference_dir) if reference_dir is not None else None
    stock_config(model_dir, adapter)  # the tokenizer reads config.json through transformers too
    tokenizer = load_tokenizer(model_dir)
    stream = tokenize_documents(load_documents(data, default_part="heldout"), tokenizer)
    windows = consecutive_windows(stream, seq_len, max_tokens)
    if adapter.encoder_output_norm is not None:
        windows = seq2seq_windows(windows.input_ids, windows.tags, tokenizer, adapter.config, SEQ2SEQ_SEED)
    if not whole_model:
        from .streamed import evaluate_streamed, whole_model_reason

        reasons = [
            f"{directory}: {reason}"
            for directory in (model_dir, reference_dir)
            if directory is not None and (reason := whole_model_reason(directory)) is not None
        ]
        if not reasons:
            return evaluate_streamed(model_dir, windows, reference_dir, progress=progress)
        event("eval", f"evaluating with the whole models in memory, not layer by layer: {'; '.join(reasons)}")
    device = compute_device()
    placement = {"": str(device)} if device.type != "cpu" else None
    model = load_model(model_dir, adapter, device_map=placement)
    reference = None
    if reference_dir is not None:
        reference = (load_model(reference_dir, ref_adapter, device_map=placement), ref_adapter)
    return evaluate_windows(model, adapter, windows, reference, progress=progress)


def evaluation_report(
    model_dir: Path,
    data: str,
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    max_tokens: int | None = None,
    reference_dir: Path | None = None,
    progress: bool = True,
    whole_model: bool = False,
) -> dict:
    """:func:`evaluate`, as the ``eval`` entry of a pass's report (the data source with the figures)."""
    result = evaluate(
        model_dir,
        data,
        seq_len=seq_len,
        max_tokens=max_tokens,
        reference_dir=reference_dir,
        progress=progress,
        whole_model=whole_model,
    )
    return {"data": data, **result.to_json()}
