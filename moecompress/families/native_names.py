"""Releases stored under their native names, which transformers' conversion mapping renames at load and
``save_pretrained`` writes back (Mistral Large 4, Inkling, Inkling 2), and the ordered regex renames that mapping
applies (also DeepSeek-V4's, Ergo's and HY-V4's)."""

from __future__ import annotations

import re
from typing import ClassVar

import torch

Renames = tuple[tuple[re.Pattern[str], str], ...]


def compile_renames(*rules: tuple[str, str]) -> Renames:
    """``(pattern, replacement)`` rules, compiled, for :func:`apply_renames`."""
    return tuple((re.compile(pattern), replacement) for pattern, replacement in rules)


def apply_renames(renames: Renames, name: str) -> str:
    """Every rule in order, each on what the ones before it left."""
    for pattern, replacement in renames:
        name = pattern.sub(replacement, name)
    return name


def with_runtime_prefix(prefixes: tuple[tuple[str, str], ...], name: str) -> str:
    """``name`` with the runtime prefix of the first ``(disk, runtime)`` pair whose disk prefix it starts with;
    ``name`` itself where none does."""
    for disk, runtime in prefixes:
        if name.startswith(disk):
            return runtime + name[len(disk) :]
    return name


class RuntimeOutsideState:
    """Mixin, listed before the family's adapter class: the tensors outside the decoder layers under their
    :meth:`runtime_module_name`, without the other towers' (:meth:`is_vision_key`), which are passed through untouched
    and have no place in the calibration skeleton."""

    def runtime_outside_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.runtime_module_name(key): value for key, value in state.items() if not self.is_vision_key(key)}


class NativeNames(RuntimeOutsideState):
    """Mixin, listed before the family's adapter class. A layer-local name takes its runtime name through
    ``local_renames``; a quantised output stores it back through ``stored_renames`` so that transformers' renaming at
    load applies once (none: the runtime name is stored); a name outside the layers takes the runtime prefix of the
    first ``outside_prefixes`` disk prefix it starts with. The vision keys stay out of the outside state."""

    local_renames: ClassVar[Renames] = ()
    stored_renames: ClassVar[Renames] = ()
    outside_prefixes: ClassVar[tuple[tuple[str, str], ...]] = ()

    def runtime_local_name(self, local_key: str) -> str:
        return apply_renames(self.local_renames, local_key)

    def stored_local_name(self, runtime_local: str) -> str:
        return apply_renames(self.stored_renames, runtime_local)

    def runtime_name_of_stored(self, stored_local: str) -> str:
        return self.runtime_local_name(stored_local) if self.stored_renames else stored_local

    def runtime_module_name(self, name: str) -> str:
        layer = self.layer_of_key(name)
        if layer is not None:
            local = name[len(self.layer_prefix(layer)) :]
            return f"{self.runtime_layers_path}.{layer}.{self.runtime_local_name(local)}"
        return with_runtime_prefix(self.outside_prefixes, name)
