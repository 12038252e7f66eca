"""The YAML a recipe is read with: PyYAML's safe loader, refusing what would make a recipe mean something its
writer did not see. A key twice in one mapping (at any depth) is refused, where plain YAML keeps the last value
silently (a second ``passes:`` would drop the first's passes); aliases (``*name``) are refused outright, so that
a few hundred bytes cannot expand into gigabytes of nodes and messages."""

from __future__ import annotations

from typing import Any

import yaml


class RecipeYAMLError(yaml.YAMLError):
    def __init__(self, message: str, mark: Any):
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        super().__init__(where + message)


class RecipeLoader(yaml.SafeLoader):
    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise RecipeYAMLError(f"alias *{event.anchor}: recipes do not take YAML aliases", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:
                    continue
                if first is not key_node:
                    shown = repr(key) if len(repr(key)) <= 40 else repr(key)[:37] + "..."
                    raise RecipeYAMLError(
                        f"duplicate key {shown} (first on line {first.start_mark.line + 1})", key_node.start_mark
                    )
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    """The YAML document in ``text``; :class:`yaml.YAMLError` (or :class:`RecipeYAMLError`) when it is not one."""
    return yaml.load(text, Loader=RecipeLoader)
