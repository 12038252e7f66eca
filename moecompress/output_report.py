"""The output's ``moecompress_report.json``: what the passes, the pipeline and the recipe runner write and update."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .files import write_json

REPORT_NAME = "moecompress_report.json"


def update_report(out_dir: Path, report: dict[str, Any]) -> None:
    """Replace the output's moecompress_report.json in one step."""
    write_json(out_dir / REPORT_NAME, report)
