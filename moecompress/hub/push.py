"""Upload a finished moecompress output to the Hub in one commit, with its model card as README.md.

The output directory is only read: the card goes up from memory as README.md (replacing any README.md the
directory holds) and every other file goes up as it is. The token is handed to huggingface_hub and never
echoed, not even in error messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import INCOMPLETE_MARKER
from ..errors import OptionError, UserInputError
from ..vocabulary import named
from .card import CardInfo, build_card, load_report

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
CARD_NAME = "README.md"


@dataclass(frozen=True)
class PushPlan:
    """What one push uploads: the directory's files (path in the repo, local path) and the generated card."""

    directory: Path
    repo_id: str
    files: list[tuple[str, Path]]
    card: CardInfo
    replaces_readme: bool

    @property
    def total_bytes(self) -> int:
        return sum(local.stat().st_size for _, local in self.files) + len(self.card.text.encode())


def check_repo_id(repo_id: str) -> None:
    """Refuse anything but ``ORG/NAME`` with the Hub's allowed characters."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not _REPO_ID.match(repo_id) or ".." in repo_id or "--" in repo_id or repo_id.endswith((".git", ".")):
        raise OptionError(f"{named('repo_id', repr(repo_id))}: expected ORG/NAME (letters, digits, '-', '_', '.')")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise OptionError(f"{named('repo_id', repr(repo_id))}: {str(error).splitlines()[0]}") from None


def check_output(directory: Path) -> dict:
    """The report of the finished moecompress output in ``directory``; anything else is a user error."""
    if not directory.is_dir():
        raise UserInputError(f"{directory}: no such directory")
    if (directory / INCOMPLETE_MARKER).exists():
        raise UserInputError(f"{directory}: an unfinished moecompress output ({INCOMPLETE_MARKER} is present)")
    report = load_report(directory)
    if report is None:
        raise UserInputError(f"{directory}: not a moecompress output (no readable moecompress_report.json)")
    if not (directory / "config.json").is_file():
        raise UserInputError(f"{directory}: has no config.json")
    if not any(directory.glob("*.safetensors")):
        raise UserInputError(f"{directory}: has no .safetensors weights")
    return report


def output_files(directory: Path) -> list[tuple[str, Path]]:
    """Every file under ``directory`` as (path in repo, local path), sorted; hidden entries and README.md skipped."""
    files = []
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if any(part.startswith(".") for part in relative.parts) or not path.is_file():
            continue
        if relative.as_posix() == CARD_NAME:
            continue
        files.append((relative.as_posix(), path))
    return files


def plan_push(directory: Path, repo_id: str, *, base_model: str | None = None) -> PushPlan:
    """Check ``directory`` and ``repo_id`` and build the card; nothing is sent anywhere."""
    check_repo_id(repo_id)
    if base_model is not None:
        try:
            check_repo_id(base_model)
        except UserInputError:
            raise OptionError(f"{named('base_model', repr(base_model))}: expected a Hub id ORG/NAME") from None
    directory = Path(directory)
    report = check_output(directory)
    card = build_card(directory, report, repo_id=repo_id, base_model=base_model)
    return PushPlan(directory, repo_id, output_files(directory), card, (directory / CARD_NAME).is_file())


def push_plan(
    plan: PushPlan,
    *,
    token: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Create the repo (and branch) if needed and upload the plan in one commit; returns the commit URL.

    The endpoint is huggingface_hub's (``HF_ENDPOINT``). ``private`` only applies when the repo is created;
    without it the namespace's default visibility is used.
    """
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    api = HfApi(token=token)
    passes = " + ".join(step.name for step in plan.card.steps)
    message = commit_message or f"Upload {passes} output with moecompress"
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(local)) for name, local in plan.files]
    operations.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=plan.card.text.encode()))
    try:
        api.create_repo(plan.repo_id, private=True if private else None, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(plan.repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.create_commit(plan.repo_id, operations, commit_message=message, revision=revision, repo_type="model")
    except OfflineModeIsEnabled:
        raise UserInputError("huggingface_hub is in offline mode (HF_HUB_OFFLINE is set): unset it to push") from None
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else "?"
        detail = _scrub(str(error).splitlines()[0], token)
        raise UserInputError(f"{plan.repo_id}: the Hub refused the push (HTTP {status}): {detail}") from None
    except (OSError, ValueError, KeyError, RuntimeError, *_transport_errors()) as error:
        detail = _scrub(str(error).splitlines()[0] if str(error) else type(error).__name__, token)
        raise UserInputError(f"{plan.repo_id}: the push to {api.endpoint} failed: {detail}") from None
    return info.commit_url


def _transport_errors() -> tuple[type[Exception], ...]:
    """The HTTP client's own error base classes (huggingface_hub's client is httpx2 or httpx, by version)."""
    errors = []
    for name in ("httpx2", "httpx"):
        try:
            errors.append(__import__(name).HTTPError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _scrub(text: str, token: str) -> str:
    return text.replace(token, "***") if token else text
