"""The unit every calibration and evaluation source yields: a text with a tag."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Document:
    """One text of a source.

    ``tag`` names the domain (or, for multimodal sources, the modality) every token of the text carries
    through calibration, so passes can weigh tokens by where they came from.
    """

    text: str
    tag: str
    id: str
