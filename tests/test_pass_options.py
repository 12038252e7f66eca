"""Each pass option is declared once, on its config field (issue 29): every field of every registered pass declares
its option or says it is a recipe key only, every option of a pass command comes from a config field, the flags
that messages name exist, and docs/recipe_keys.md is what the declarations give."""

import dataclasses
import importlib.util
import re
import subprocess
import sys
import typing
from pathlib import Path

import click
import pytest

from moecompress.cli.main import app
from moecompress.cli.pass_options import GENERATED, config_from_options
from moecompress.passes.options import flag, option_of
from moecompress.passes.registry import PASSES

ROOT = Path(__file__).parent.parent

PASS_COMMANDS = {"prune": "prune_experts", "quantize": "quantize", "prune-heads": "prune_heads", "qat": "qat"}
"""Each one-pass command and its pass."""

COMMAND_OPTIONS = {
    "model",
    "out_dir",
    "calib",
    "calib_tokens",
    "seq_len",
    "eval_data",
    "eval_tokens",
    "no_eval",
    "overwrite",
    "device",
    "resume",
    "restart",
    "quiet",
    "log_json",
    "trust_remote_code",
    "allow_pickle",
    "image_size",
}
"""Options that are not a pass's: the model, the output, calibration, evaluation, the run and trust options."""


def _all_configs():
    """Every registered pass's config class and the config classes nested in them (QAT's quantize)."""
    seen, todo = [], [entry.config for entry in PASSES.values()]
    while todo:
        cls = todo.pop(0)
        if cls not in seen:
            seen.append(cls)
            todo.extend(hint for hint in typing.get_type_hints(cls).values() if dataclasses.is_dataclass(hint))
    return seen


@pytest.mark.parametrize("cls", _all_configs(), ids=lambda cls: cls.__name__)
def test_every_config_field_declares_its_option(cls):
    missing = [f.name for f in dataclasses.fields(cls) if option_of(f) is None]
    assert not missing, f"{cls.__name__}: no option(...) or recipe_only(...) in the metadata of {missing}"
    for f in dataclasses.fields(cls):
        assert option_of(f).help.strip(), f"{cls.__name__}.{f.name} has no help"


@pytest.mark.parametrize("command_name", list(PASS_COMMANDS))
def test_every_option_of_a_pass_command_is_a_config_field_or_a_command_option(command_name):
    command = app.commands[command_name]
    stray = []
    for param in command.params:
        generated = getattr(param, GENERATED, None)
        if generated is not None:
            cls_name, field = generated
            assert field in {
                f.name for cls in _all_configs() if cls.__name__ == cls_name for f in dataclasses.fields(cls)
            }
        elif param.name not in COMMAND_OPTIONS:
            stray.append(param.opts[0] if param.opts else param.name)
    assert not stray, f"{command_name}: options declared by hand, not from the pass's config: {stray}"
    generated = {getattr(p, GENERATED)[1] for p in command.params if hasattr(p, GENERATED)}
    assert generated, command_name


@pytest.mark.parametrize("cls", _all_configs(), ids=lambda cls: cls.__name__)
def test_the_flags_the_messages_name_are_real_flags(cls):
    """validate()'s messages name flags; each must be an option of some command (a renamed flag breaks this)."""
    import inspect

    flags = {
        name.split("/")[0]
        for command in app.commands.values()
        if isinstance(command, click.Command)
        for param in command.params
        for name in (*param.opts, *param.secondary_opts)
    }
    named = set(re.findall(r"(--[a-z][a-z-]+)", inspect.getsource(cls)))
    assert named - flags == set(), named - flags


def test_the_generated_options_parse_back_into_the_config():
    command = app.commands["quantize"]
    args = [
        "M",
        "--out",
        "O",
        "--scheme",
        "int4",
        "--group-size",
        "64",
        "--asymmetric",
        "--targets",
        "experts, lm_head",
    ]
    params = dict(command.make_context("quantize", args).params)
    config = config_from_options(PASSES["quantize"].config, params)
    assert (config.scheme, config.group_size, config.symmetric, config.targets) == (
        "int4",
        64,
        False,
        ("experts", "lm_head"),
    )
    assert config.lowrank_rank == 0 and config.gptq_block == 128
    assert "scheme" not in params and params["calib"] == "builtin:prose"
    assert flag(PASSES["quantize"].config, "symmetric") == "--symmetric"


def test_importing_the_command_line_imports_no_pass():
    """The options are generated when a command's parameters are first read, so ``moecompress --help`` stays fast."""
    code = (
        "import sys, moecompress.cli.main; "
        "print(sorted(m for m in sys.modules if m.startswith('moecompress.passes.') or m == 'torch'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "['moecompress.passes.options']"


def test_docs_recipe_keys_is_what_the_declarations_give():
    spec = importlib.util.spec_from_file_location("recipe_keys_table", ROOT / "scripts" / "recipe_keys_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    written = (ROOT / "docs" / "recipe_keys.md").read_text()
    assert written == table.render(), "docs/recipe_keys.md is out of date: run python scripts/recipe_keys_table.py"
    for entry in PASSES.values():
        for field in dataclasses.fields(entry.config):
            assert f"| `{field.name}` |" in written


def test_keep_alone_prunes_to_that_count_from_the_command_line_and_from_a_recipe():
    """The default ratio applies only when neither ratio nor keep is given, in the config itself, so ``--keep 4``
    and a recipe's ``{keep: 4}`` mean the same (a recipe needed ``ratio: null`` before)."""
    from moecompress.runner.recipes import parse_recipe

    params = dict(app.commands["prune"].make_context("prune", ["M", "--out", "O", "--keep", "4"]).params)
    from_cli = config_from_options(PASSES["prune_experts"].config, params)
    ((_, from_recipe),) = parse_recipe({"model": "M", "passes": [{"prune_experts": {"keep": 4}}]}).passes
    assert from_cli == from_recipe and (from_cli.ratio, from_cli.keep) == (None, 4)
    assert PASSES["prune_experts"].config().ratio == 0.25


def _ignored_cases():
    """Every generated option of prune and quantize that the command's defaults leave unused (its ``applies`` is
    false on them), given with its own default value."""
    from moecompress.passes.options import option_of as declared_of

    cases = []
    for command_name in ("prune", "quantize", "prune-heads"):
        command = app.commands[command_name]
        cls = next(PASSES[name].config for name in command.pass_names)
        for param in command.params:
            if not hasattr(param, GENERATED):
                continue
            field = next(f for f in dataclasses.fields(cls) if f.name == param.name)
            applies = declared_of(field).applies
            if applies is None or applies.test(cls(ratio=0.5) if command_name == "prune-heads" else cls()):
                continue
            if param.is_flag or param.secondary_opts:
                args = [param.opts[0]]
            else:
                default = param.default if param.default is not None else "1"
                args = [param.opts[0], str(default)]
            cases.append(pytest.param(command_name, args, id=f"{command_name} {' '.join(args)}"))
    return cases


@pytest.mark.parametrize(("command_name", "args"), _ignored_cases())
def test_an_option_the_defaults_leave_unused_is_refused_when_given(command_name, args, tmp_path):
    """Defaults are not "given": the same value left out passes this check, given it is refused naming the flag."""
    from moecompress.errors import UserInputError

    base = [command_name, "builtin:tiny-moe", "--out", str(tmp_path / "o"), "--no-eval"]
    base += ["--ratio", "0.5"] if command_name == "prune-heads" else []
    with pytest.raises(UserInputError, match="applies only with") as raised:
        app.main([*base, *args], standalone_mode=False)
    assert str(raised.value).startswith(args[0] + " "), str(raised.value)
    assert not (tmp_path / "o").exists()


def test_the_applies_table_covers_the_issue_examples():
    """The options issue 40 found silently ignored are declared with the condition they need."""
    from moecompress.passes.prune_experts import PruneExpertsConfig
    from moecompress.passes.quantize import QuantizeConfig

    expected = {
        (QuantizeConfig, "symmetric"): QuantizeConfig(scheme="mxfp4"),
        (QuantizeConfig, "gptq_damp"): QuantizeConfig(method="rtn"),
        (QuantizeConfig, "scale_rule"): QuantizeConfig(scheme="int4"),
        (QuantizeConfig, "rank_alloc"): QuantizeConfig(lowrank_rank=4),
        (PruneExpertsConfig, "min_keep"): PruneExpertsConfig(scope="layer"),
        (PruneExpertsConfig, "greedy"): PruneExpertsConfig(method="reap"),
    }
    for (cls, name), config in expected.items():
        declared = option_of(next(f for f in dataclasses.fields(cls) if f.name == name))
        assert declared.applies is not None and not declared.applies.test(config), (cls.__name__, name)
    assert option_of(next(f for f in dataclasses.fields(QuantizeConfig) if f.name == "symmetric")).applies.test(
        QuantizeConfig(scheme="int2")
    )


def _outside(cls: type, field: dataclasses.Field):
    """A value just outside ``field``'s declared choices or range (None: it declares neither)."""
    from moecompress.passes.options import choices_of, field_default, value_type

    declared = option_of(field)
    base, _ = value_type(cls, field)
    if choices_of(cls, field, declared) is not None:
        return 3 if base is int else "nonsense"
    if declared.min is not None:
        value = declared.min if declared.min_open else declared.min - (1 if base is int else 0.5)
        value -= 1 if value == field_default(field) else 0  # the default is always accepted (lowrank_rank's 0)
    elif declared.max is not None:
        value = declared.max if declared.max_open else declared.max + (1 if base is int else 0.5)
    else:
        return None
    return float(value) if base is float else int(value)


DECLARED_LIMITS = [
    (name, field.name, value)
    for name, entry in PASSES.items()
    for field in dataclasses.fields(entry.config)
    if (value := _outside(entry.config, field)) is not None
]
COMMAND_OF = {pass_name: command for command, pass_name in PASS_COMMANDS.items()}
REQUIRED = {"prune_heads": ["--ratio", "0.5"], "qat": ["--scheme", "int2"]}


def _refusal(call) -> str:
    from moecompress.errors import OptionError

    with pytest.raises(OptionError) as raised:
        call()
    return str(raised.value)


@pytest.mark.parametrize(
    ("pass_name", "key", "value"), DECLARED_LIMITS, ids=[f"{p}.{k}" for p, k, _ in DECLARED_LIMITS]
)
def test_every_declared_range_and_choice_is_refused_by_every_caller_in_its_spelling(pass_name, key, value, tmp_path):
    """Issue 37 item 3: the declarations alone refuse a value (no hand check in validate() needed): a recipe names
    the key's path, the API the argument, the command line the flag, each with the same reason."""
    import moecompress
    from moecompress.runner.recipes import parse_recipe

    recipe = _refusal(lambda: parse_recipe({"model": "builtin:tiny-moe", "passes": [{pass_name: {key: value}}]}))
    assert recipe.startswith(f"passes[0].{pass_name}.{key} {value} "), recipe
    reason = recipe.removeprefix(f"passes[0].{pass_name}.{key} {value} ")
    assert reason.startswith(("must be", "is not one of")), recipe
    api = {"prune_experts": moecompress.prune, "quantize": moecompress.quantize}.get(pass_name)
    if api is not None:
        message = _refusal(lambda: api("builtin:tiny-moe", tmp_path / "a", **{key: value}))
        assert message == f"{api.__name__}(): {key}={value!r} {reason}"
    cls = PASSES[pass_name].config
    command = COMMAND_OF[pass_name]
    if (cls.__name__, key) in {getattr(param, GENERATED, None) for param in app.commands[command].params}:
        flag_name = flag(cls, key)
        args = [command, "builtin:tiny-moe", "--out", str(tmp_path / "c"), *REQUIRED.get(pass_name, [])]
        message = _refusal(lambda: app.main([*args, flag_name, str(value)], standalone_mode=False))
        assert message == f"{flag_name} {value} {reason}"
    assert list(tmp_path.iterdir()) == []


def test_a_config_built_in_python_is_held_to_its_declarations():
    from moecompress.errors import OptionError
    from moecompress.passes.prune_heads import PruneHeadsConfig
    from moecompress.passes.quantize import QuantizeConfig

    with pytest.raises(OptionError, match=r"--group-size 32 is not a whole number"):
        QuantizeConfig(group_size="32").validate()
    with pytest.raises(OptionError, match=r"warmup_fraction 1.5 must be in \(0, 1\]"):
        PruneHeadsConfig(warmup_fraction=1.5).validate()
    QuantizeConfig(lowrank_rank=0).validate()  # the default (no adapters) lies outside the range a caller sets


FLAG_IN_TEXT = re.compile(r"(?<![\w-])--[a-z][a-z-]+")
EXTERNAL_TOOL_FLAGS: dict[str, str] = {}
"""Flags of other programs (llama.cpp's converter, llama-quantize) that a refusal may quote, with the program: the
only ``--flags`` a message outside moecompress/cli/ may spell literally. None does today."""


def _flags_in_refusals(path: Path) -> set[str]:
    """The ``--flags`` in the string constants of the raise statements and ``...Error(...)`` calls of ``path``."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        refusal = isinstance(node, ast.Raise) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.endswith("Error")
        )
        if refusal:
            for text in ast.walk(node):
                if isinstance(text, ast.Constant) and isinstance(text.value, str):
                    found |= set(FLAG_IN_TEXT.findall(text.value))
    return found


def test_no_message_outside_the_command_line_spells_a_flag():
    """Issue 37 item 3: a refusal outside moecompress/cli/ names an option with named(), so recipe and API callers
    read their own spelling (the command line reads the flag); only other programs' flags are spelled literally."""
    spelled = {
        f"{path.relative_to(ROOT)}: {flag_text}"
        for path in sorted((ROOT / "moecompress").rglob("*.py"))
        if "cli" not in path.relative_to(ROOT).parts
        for flag_text in _flags_in_refusals(path) - set(EXTERNAL_TOOL_FLAGS)
    }
    assert not spelled, sorted(spelled)


def test_the_flag_finder_finds_a_flag_in_a_refusal(tmp_path):
    source = tmp_path / "refusing.py"
    source.write_text(
        'def f(x):\n    if x:\n        raise UserInputError(f"--out {x}: exists")\n'
        '    return OptionError("see --help")\n'
        '"""--docstring-flag is not a message."""\n'
    )
    assert _flags_in_refusals(source) == {"--out", "--help"}


def _named_outside_option_errors(path: Path) -> list[int]:
    """Lines of ``path`` where an error other than OptionError is built with named(): its placeholder would be
    printed as it is (``{format=bf16}``), since only an OptionError renders it."""
    import ast

    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        plain = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.endswith("Error")
        if plain and node.func.id != "OptionError":
            calls = (n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name))
            if any(call.func.id == "named" for call in calls):
                lines.append(node.lineno)
    return lines


def test_only_an_option_error_names_options():
    found = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / "moecompress").rglob("*.py"))
        if (lines := _named_outside_option_errors(path))
    }
    assert not found, found


def test_the_named_finder_finds_a_placeholder_in_a_plain_error(tmp_path):
    source = tmp_path / "plain.py"
    source.write_text(
        "def f(x):\n"
        "    raise UserInputError(f\"{x}: use {named('format', 'bf16')}\")\n"
        "def g(x):\n"
        "    raise OptionError(f\"{x}: use {named('format', 'bf16')}\")\n"
    )
    assert _named_outside_option_errors(source) == [2]
