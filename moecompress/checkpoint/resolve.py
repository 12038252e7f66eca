"""Turn what a user typed (a directory, ``builtin:tiny-moe``, a hub id) into a local model directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import UserInputError

BUILTIN_MODELS = {"tiny-moe": Path(__file__).resolve().parent.parent / "assets" / "tiny-moe"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def resolve_model(spec: str, *, revision: str | None = None) -> Path:
    """A local directory holding the model named by ``spec``.

    ``builtin:NAME`` names a model shipped in the package; an existing path is used as it is; otherwise a
    ``org/name`` spec is fetched through huggingface_hub (its cache, so ``HF_HUB_OFFLINE=1`` works from a
    warm cache). Weights other than safetensors are never fetched.
    """
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name not in BUILTIN_MODELS:
            raise UserInputError(
                f"unknown built-in model {spec!r}; available: builtin:{', builtin:'.join(BUILTIN_MODELS)}"
            )
        path = BUILTIN_MODELS[name]
        if not (path / "config.json").is_file():
            raise UserInputError(f"{spec}: the built-in model is missing from this install ({path})")
        return path
    path = Path(os.path.expanduser(spec))
    if path.exists():
        if not path.is_dir():
            raise UserInputError(f"{spec}: not a directory (a model is a directory with config.json)")
        return path
    if not _HUB_ID.match(spec) or spec.startswith((".", "/", "~")):
        raise UserInputError(f"{spec}: no such model directory")
    return _from_hub(spec, revision)


def _from_hub(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_FILES))
    except RepositoryNotFoundError:
        raise UserInputError(f"{repo_id}: no such local directory or Hub repository") from None
    except LocalEntryNotFoundError:
        raise UserInputError(
            f"{repo_id}: not a local directory, not in the Hugging Face cache, and the Hub cannot be reached"
        ) from None
    except (HfHubHTTPError, OSError) as error:
        raise UserInputError(f"{repo_id}: could not fetch from the Hub ({str(error).splitlines()[0]})") from None
