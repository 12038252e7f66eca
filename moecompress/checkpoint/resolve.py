"""Turn what a user typed (a directory, ``builtin:tiny-moe``, a hub id) into a local model directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import UserInputError

BUILTIN_MODELS = {"tiny-moe": Path(__file__).resolve().parent.parent / "assets" / "tiny-moe"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SIDE_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
_INDEX = "model.safetensors.index.json"
_SUBFOLDERS = "*/*"
"""Anything below the top level: gpt-oss's ``original/`` and ``metal/`` weights and the like, which
``from_pretrained`` on the repository root never reads."""


def hub_patterns(index: dict | None) -> tuple[list[str], list[str]]:
    """``(allow_patterns, ignore_patterns)`` that fetch what ``from_pretrained`` loads from a repository's root:
    the config and tokenizer files, and the shards the safetensors index names (``model.safetensors`` without an
    index; any top-level ``*.safetensors`` but Mistral's duplicate ``consolidated*`` when the index could not be
    read). Nothing in subfolders."""
    if index is None:
        return [*_SIDE_FILES, "*.safetensors"], [_SUBFOLDERS, "consolidated*.safetensors"]
    weights = sorted(set((index.get("weight_map") or {}).values())) or ["model.safetensors"]
    return [*_SIDE_FILES, *weights], [_SUBFOLDERS]


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


HUB_PROBE_TIMEOUT = 5.0
"""Seconds the first request to the Hub may take: a machine without network fails at once instead of after
huggingface_hub's retries (23-56 s)."""


def _from_hub(repo_id: str, revision: str | None) -> Path:
    """``repo_id`` from the Hugging Face cache when offline (``HF_HUB_OFFLINE``) or when one short request finds the
    Hub unreachable; otherwise fetched (and cached)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        return _from_cache(repo_id, revision, "HF_HUB_OFFLINE is set")
    unreachable = _probe_hub(repo_id, revision)
    if unreachable is not None:
        return _from_cache(repo_id, revision, f"the Hub cannot be reached: {unreachable}")
    try:
        allow, ignore = hub_patterns(_hub_index(repo_id, revision))
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=allow, ignore_patterns=ignore))
    except RepositoryNotFoundError:
        raise UserInputError(f"{repo_id}: no such local directory or Hub repository") from None
    except LocalEntryNotFoundError:
        raise UserInputError(
            f"{repo_id}: not a local directory, not in the Hugging Face cache, and the Hub cannot be reached"
        ) from None
    except (HfHubHTTPError, OSError) as error:
        raise UserInputError(f"{repo_id}: could not fetch from the Hub ({str(error).splitlines()[0]})") from None


def _probe_hub(repo_id: str, revision: str | None) -> str | None:
    """One request for the repository's metadata, with a short timeout and no retries: None when the Hub
    answered, else why it could not be reached. A repository or revision the Hub says does not exist is
    refused here."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        HfApi().model_info(repo_id, revision=revision, timeout=HUB_PROBE_TIMEOUT)
    except GatedRepoError:
        return None  # the download that follows says what access is missing
    except RepositoryNotFoundError:
        raise UserInputError(f"{repo_id}: no such local directory or Hub repository") from None
    except RevisionNotFoundError:
        raise UserInputError(f"{repo_id}: the Hub has no revision {revision!r}") from None
    except HfHubHTTPError as error:
        return str(error).splitlines()[0]
    except Exception as error:  # the HTTP client's connection and timeout errors, which it does not export stably
        return str(error).splitlines()[0] if str(error).strip() else type(error).__name__
    return None


def _from_cache(repo_id: str, revision: str | None, why: str) -> Path:
    """The cached snapshot of ``repo_id``, without any request; one line saying ``why`` the cache was the only
    place to look when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, OSError):
        raise UserInputError(f"{repo_id}: not a local directory, and not in the Hugging Face cache ({why})") from None


def _hub_index(repo_id: str, revision: str | None) -> dict | None:
    """The repository's safetensors index; ``{}`` when it has none (one ``model.safetensors``), None when it
    cannot be read (offline without it in the cache)."""
    import json

    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        path = hf_hub_download(repo_id, _INDEX, revision=revision)
    except LocalEntryNotFoundError:
        return None
    except EntryNotFoundError:
        return {}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
