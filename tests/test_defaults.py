"""Issue 37 item 3: each shared default lives once, in moecompress/defaults.py. A function's, a field's or an
option's default spelled as one of those literals anywhere else in the package is a copy that would drift."""

import ast
from pathlib import Path

from moecompress import defaults

ROOT = Path(__file__).parent.parent
SHARED = {
    name: value
    for name, value in vars(defaults).items()
    if name.startswith("DEFAULT_") and isinstance(value, (int, str)) and not isinstance(value, bool)
}
DISTINCT = {defaults.DEFAULT_DATA, defaults.DEFAULT_IMAGE_SIZE}
"""Defaults no other number or string in the package equals, refused wherever they appear (256 and 16384 are also
GGML super-block widths and block sizes, refused only where they are a default)."""


def _defaults(tree: ast.AST):
    """The default expressions of ``tree``: parameters, annotated fields, ``default=`` arguments."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from (d for d in [*node.args.defaults, *node.args.kw_defaults] if d is not None)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            yield node.value
        elif isinstance(node, ast.Call):
            yield from (k.value for k in node.keywords if k.arg == "default")


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def copies(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for default in _defaults(tree):
        if isinstance(default, ast.Constant) and type(default.value) in (int, str):
            found += [f"{path.name}:{default.lineno}: {default.value!r}" for v in SHARED.values() if default.value == v]
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in docs and type(node.value) in (int, str):
            if node.value in DISTINCT:
                found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    return sorted(set(found))


def test_no_shared_default_is_spelled_outside_defaults_py():
    spelled = [
        f"{path.relative_to(ROOT)} {copy}"
        for path in sorted((ROOT / "moecompress").rglob("*.py"))
        if path.name != "defaults.py"
        for copy in copies(path)
    ]
    assert not spelled, spelled


def test_the_finder_finds_each_kind_of_copy(tmp_path):
    source = tmp_path / "copying.py"
    source.write_text(
        "def f(seq_len: int = 256, source='builtin:prose'):\n"
        "    return g(x, 224)\n"
        "class C:\n"
        "    tokens: int = 16384\n"
        "option('--eval-tokens', default=16384)\n"
        "WIDTH = 256\n"
        '"""builtin:prose in a docstring is prose."""\n'
    )
    assert copies(source) == [
        "copying.py:1: 'builtin:prose'",
        "copying.py:1: 256",
        "copying.py:2: 224",
        "copying.py:4: 16384",
        "copying.py:5: 16384",
    ]
