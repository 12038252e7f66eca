"""A registry of behaviours by name: the weight schemes (:mod:`moecompress.quantization.schemes`), the output
formats (:mod:`moecompress.quantization.formats`) and the input decoders (:mod:`moecompress.checkpoint.decoders`)
are each a :class:`Registry`, filled by its ``register`` class decorator as their modules are imported (or by a
test or a user's script before use)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """``name → instance``: the one instance of each registered class, under the class attribute ``key`` (``name``
    unless told); ``what`` names an entry in :meth:`lookup`'s error."""

    def __init__(self, what: str, key: str = "name") -> None:
        super().__init__()
        self.what = what
        self.key = key

    def register(self, cls: type[T]) -> type[T]:
        """Class decorator: make ``cls`` the entry under its ``key`` attribute (replacing one of that name)."""
        self[getattr(cls, self.key)] = cls()
        return cls

    def unregister(self, name: str) -> None:
        self.pop(name, None)

    def lookup(self, name: str) -> T:
        """The entry called ``name``; a ValueError naming the choices where there is none."""
        found = self.get(name)
        if found is None:
            raise ValueError(f"unknown {self.what} {name!r}; choose from {tuple(self)}")
        return found


class RegisteredNames(Sequence):
    """The names in a registry, read on each use (so option choices include names registered later)."""

    def __init__(self, registry: dict[str, Any]) -> None:
        self._registry = registry

    def _names(self) -> tuple[str, ...]:
        return tuple(self._registry)

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._registry)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._registry

    def __repr__(self) -> str:
        return repr(self._names())
