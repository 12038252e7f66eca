"""The table a run ends with: what changed between the input and the output checkpoint.

:func:`measure_outcome` reads both checkpoints' configs and shard headers (no weights) and the evaluation, and
stores the figures in the report (``outcome``), so ``moecompress report DIR`` reprints the table without the
input at hand and :func:`plot_runs` can compare runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointReader
from ..errors import OptionError, UserInputError
from ..evals.footprint import checkpoint_footprint
from ..families import adapter_for
from ..files import write_bytes
from ..output_report import REPORT_NAME
from ..vocabulary import named


def _structure(directory: Path) -> dict[str, Any]:
    with CheckpointReader(directory) as reader:
        adapter = adapter_for(reader.config, source=str(directory))
        shape = adapter.shape()
        heads = [adapter.heads_in_layer(layer) for layer in range(shape.num_layers)]
    footprint = checkpoint_footprint(directory).to_json()
    experts = footprint["classes"].get("experts", {})
    return {
        "experts": sum(shape.experts_per_layer.values()),
        "query_heads": sum(h for h, _ in heads),
        "kv_heads": sum(kv for _, kv in heads),
        "bytes": footprint["total"]["bytes"],
        "bits_per_weight": footprint["total"]["bits_per_weight"],
        "expert_bits_per_weight": experts.get("bits_per_weight", 0.0),
    }


def measure_outcome(model_dir: Path, out_dir: Path, evaluation: dict[str, Any] | None) -> dict[str, Any]:
    """``{figure: [input, output]}`` for the summary table; perplexity and agreement when evaluated."""
    before, after = _structure(Path(model_dir)), _structure(Path(out_dir))
    outcome: dict[str, Any] = {name: [before[name], after[name]] for name in before}
    if evaluation is not None:
        outcome["perplexity"] = [evaluation["reference_perplexity"], evaluation["perplexity"]]
        outcome["kl_nats_per_token"] = [0.0, evaluation["kl"]]
        outcome["routing_agreement"] = [1.0, evaluation["routing_agreement"]]
        outcome["eval_data"] = evaluation.get("data")
        outcome["eval_tokens"] = evaluation.get("tokens")
        outcome["eval_seq_len"] = evaluation.get("seq_len")
    return outcome


def attribute_to_input(report: dict[str, Any], model_dir: Path) -> None:
    """Make a recipe's final report name the recipe's real input, not the hidden step directory its last pass read:
    ``source`` and ``source_footprint`` become the input's, and each earlier pass's ``source`` is the input (the
    first) or which pass's output it read (the step directories are gone once the run ends)."""
    earlier = report.get("previous_passes") or []
    for index, previous in enumerate(earlier):
        previous["source"] = str(model_dir) if index == 0 else f"output of pass {index} ({earlier[index - 1]['pass']})"
    report["source"] = str(model_dir)
    report["source_footprint"] = checkpoint_footprint(Path(model_dir)).to_json()


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError


ROWS: tuple[tuple[str, str, Any], ...] = (
    ("experts", "routed experts", str),
    ("query_heads", "query heads", str),
    ("kv_heads", "KV heads", str),
    ("bytes", "weight bytes", _bytes),
    ("bits_per_weight", "bits/weight (all)", lambda v: f"{v:.3f}"),
    ("expert_bits_per_weight", "bits/weight (experts)", lambda v: f"{v:.3f}"),
    ("perplexity", "perplexity", lambda v: f"{v:.3f}"),
    ("kl_nats_per_token", "KL (nats/token)", lambda v: f"{v:.4f}"),
    ("routing_agreement", "routing agreement", lambda v: f"{v:.4f}"),
)


def _change(key: str, before: float, after: float) -> str:
    if key in ("kl_nats_per_token", "routing_agreement"):
        return ""
    if before == 0:
        return ""
    return f"{100 * (after - before) / before:+.1f}%"


def format_table(outcome: dict[str, Any]) -> str:
    """The outcome as an aligned text table: figure, input, output, relative change."""
    rows = [("", "input", "output", "change")]
    for key, label, show in ROWS:
        if key in outcome:
            before, after = outcome[key]
            rows.append((label, show(before), show(after), _change(key, before, after)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)).rstrip()
        for row in rows
    ]
    if outcome.get("eval_data"):
        tokens = outcome.get("eval_tokens")
        counted = f", {tokens:,} predicted tokens in windows of {outcome.get('eval_seq_len')}" if tokens else ""
        lines.append(f"(evaluated on {outcome['eval_data']}{counted}; KL and agreement are against the input model)")
    return "\n".join(lines)


def load_report(directory: Path) -> dict[str, Any]:
    path = Path(directory) / REPORT_NAME
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserInputError(f"{directory}: no {REPORT_NAME} (not a moecompress output)") from None
    except json.JSONDecodeError as error:
        raise UserInputError(f"{path}: not valid JSON ({error.msg})") from None
    if not isinstance(report, dict):
        raise UserInputError(f"{path}: not a moecompress report")
    return report


def outcome_of(directory: Path, report: dict[str, Any]) -> dict[str, Any]:
    """The report's stored outcome, or (older reports, single passes) one measured now from the output and the
    source it names, when that source is still there."""
    if "outcome" in report:
        return report["outcome"]
    source = report.get("recipe", {}).get("model") or report.get("source")
    if not source or not Path(source).is_dir():
        raise UserInputError(f"{directory}: the report has no outcome and its source {source!r} is not at hand")
    evaluation = report.get("eval")
    if evaluation is not None and "after" in evaluation:
        evaluation = {"data": evaluation.get("data"), **evaluation["after"]}
    return measure_outcome(Path(source), Path(directory), evaluation)


def draw_runs(runs: list[tuple[str, dict[str, Any]]]) -> Any:
    """The figure of :func:`plot_runs`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OptionError(f"{named('plot')} needs matplotlib (pip install 'moecompress[plots]')") from None
    evaluated = [(name, outcome) for name, outcome in runs if "perplexity" in outcome]
    if not evaluated:
        raise OptionError(f"{named('plot')}: none of the runs was evaluated (no perplexity in their reports)")
    figure, axes = plt.subplots(figsize=(8.4, 4.2))
    inputs = {(outcome["bytes"][0], outcome["perplexity"][0]) for _, outcome in evaluated}
    for number, (size, perplexity) in enumerate(sorted(inputs)):
        axes.scatter([size / 2**20], [perplexity], marker="s", color="black", label="input" if number == 0 else None)
    # Runs of similar size and perplexity sit on top of each other, and so would labels beside the points: each
    # run gets its own colour and marker, and its name goes in a legend beside the axes.
    markers, colours = "o^vD<>pP*Xh", plt.get_cmap("tab10").colors
    for index, (name, outcome) in enumerate(evaluated):
        size, perplexity = outcome["bytes"][1] / 2**20, outcome["perplexity"][1]
        axes.scatter(
            [size],
            [perplexity],
            marker=markers[index % len(markers)],
            color=colours[index % len(colours)],
            label=f"{name} ({size:.2f} MiB, {perplexity:.2f})",
        )
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    axes.set_xlabel("weight bytes (MiB)")
    axes.set_ylabel("perplexity")
    axes.set_title("perplexity against size")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def plot_runs(runs: list[tuple[str, dict[str, Any]]], path: Path) -> None:
    """Perplexity against weight bytes, one point per run (and the input model once per source), saved to
    ``path``."""
    import io

    import matplotlib.pyplot as plt

    figure, image = draw_runs(runs), io.BytesIO()
    figure.savefig(image, dpi=120, format=Path(path).suffix[1:] or None)
    plt.close(figure)
    write_bytes(path, image.getvalue())
