"""moecompress push: the model card and the one-commit upload through the real huggingface_hub client.

A local HTTP server (FakeHub) stands in for the Hub. It implements the endpoints huggingface_hub calls for
create_repo, create_branch, validate-yaml, preupload, the LFS batch/upload/verify flow and the ndjson commit,
keeps the committed files per branch, and records every request. The Xet protocol is switched off so large
files take the plain LFS path (the server marks *.safetensors as LFS, like the Hub's .gitattributes).
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml
from helpers import run_cli, tree_hashes

from moecompress.checkpoint.resolve import BUILTIN_MODELS

TOKEN = "hf_moecompressTestToken0123456789"
SNAPSHOT_REV = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Just enough of the Hub's HTTP API for huggingface_hub's upload path, recording every request."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.repos: dict[str, dict] = {}
        self.lfs: dict[str, bytes] = {}
        self.commits: list[dict] = []
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_POST(self):
                hub.handle(self)

            def do_PUT(self):
                hub.handle(self)

            def do_GET(self):
                hub.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def _body(handler: BaseHTTPRequestHandler) -> bytes:
        if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(handler.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    handler.rfile.readline()
                    return data
                data += handler.rfile.read(size)
                handler.rfile.readline()
        return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))

    def handle(self, handler: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(handler.path)
        path = unquote(parts.path)
        body = self._body(handler)
        record = {
            "method": handler.command,
            "path": path,
            "headers": {k.lower(): v for k, v in handler.headers.items()},
            "body": body,
        }
        try:
            record["json"] = json.loads(body) if body else None
        except ValueError:
            record["json"] = None
        with self.lock:
            self.requests.append(record)
            status, payload, headers = self.route(handler.command, path, record)
        data = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.end_headers()
        handler.wfile.write(data)

    def _authorized(self, record: dict) -> bool:
        return record["headers"].get("authorization") == f"Bearer {TOKEN}"

    def route(self, method: str, path: str, record: dict) -> tuple[int, dict, dict]:
        body = record["json"]
        if path.startswith("/api/") and not self._authorized(record):
            return 401, {"error": "Invalid credentials"}, {}
        if method == "POST" and path == "/api/repos/create":
            repo_id = f"{body['organization']}/{body['name']}"
            if repo_id in self.repos:
                # like the Hub, the conflict still names the repo's URL (create_repo(exist_ok=True) reads it)
                return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}, {}
            self.repos[repo_id] = {"create": body, "branches": {"main": {}}}
            return 200, {"url": f"{self.url}/{repo_id}"}, {}
        if method == "POST" and path == "/api/validate-yaml":
            text = body["content"]
            front = text.split("---\n")[1] if text.startswith("---\n") else ""
            try:
                metadata = yaml.safe_load(front)
            except yaml.YAMLError as error:
                return 400, {"errors": [{"message": str(error)}]}, {}
            return (200, {"errors": [], "warnings": []}, {}) if isinstance(metadata, dict) else (400, {}, {})
        if method == "PUT" and path.startswith("/lfs-upload/"):
            oid = path.rsplit("/", 1)[1]
            if hashlib.sha256(record["body"]).hexdigest() != oid:
                return 400, {"error": "sha256 mismatch"}, {}
            self.lfs[oid] = record["body"]
            return 200, {}, {}
        if method == "POST" and path == "/lfs-verify":
            return (200, {}, {}) if body["oid"] in self.lfs else (404, {"error": "object not found"}, {})
        if method == "POST" and path.endswith(".git/info/lfs/objects/batch"):
            objects = [
                {
                    "oid": o["oid"],
                    "size": o["size"],
                    "actions": {
                        "upload": {"href": f"{self.url}/lfs-upload/{o['oid']}"},
                        "verify": {"href": f"{self.url}/lfs-verify"},
                    },
                }
                for o in body["objects"]
            ]
            return 200, {"transfer": "basic", "objects": objects}, {}
        segments = path.split("/")
        if method == "POST" and len(segments) >= 7 and segments[:3] == ["", "api", "models"]:
            repo_id, action, revision = "/".join(segments[3:5]), segments[5], "/".join(segments[6:])
            repo = self.repos.get(repo_id)
            if repo is None:
                return 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
            if action == "branch":
                if revision in repo["branches"]:
                    return 409, {"error": "Reference already exists"}, {}
                repo["branches"][revision] = dict(repo["branches"][(body or {}).get("startingPoint") or "main"])
                return 200, {}, {}
            if revision not in repo["branches"]:
                return 404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"}
            if action == "preupload":
                files = [
                    {
                        "path": f["path"],
                        "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                        "shouldIgnore": False,
                    }
                    for f in body["files"]
                ]
                return 200, {"files": files}, {}
            if action == "commit":
                return self._commit(repo, repo_id, revision, record["body"])
        return 404, {"error": f"no route for {method} {path}"}, {}

    def _commit(self, repo: dict, repo_id: str, revision: str, body: bytes) -> tuple[int, dict, dict]:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        files = {}
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.lfs:
                    return 400, {"error": f"LFS object {value['oid']} was never uploaded"}, {}
                files[value["path"]] = self.lfs[value["oid"]]
        repo["branches"][revision].update(files)
        oid = hashlib.sha1(body).hexdigest()
        self.commits.append({"repo_id": repo_id, "revision": revision, "header": lines[0]["value"], "files": files})
        return 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid}, {}


@pytest.fixture
def hub():
    server = FakeHub()
    yield server
    server.close()


@pytest.fixture
def hub_env(hub, monkeypatch, tmp_path):
    """Point this process's huggingface_hub at the fake hub, with the test token and no Xet."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return hub


def _main(capsys, *args) -> tuple[int, str, str]:
    """Run the real console entry point in this process (exit-code mapping included)."""
    from moecompress.cli.main import main

    argv = sys.argv
    sys.argv = ["moecompress", *args]
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code or 0
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return code, out, err


def _invoke(*args) -> None:
    from click.testing import CliRunner

    from moecompress.cli.main import app

    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    """tiny-moe laid out like a Hugging Face cache snapshot of acme/tiny-moe, with a licensed README."""
    root = tmp_path_factory.mktemp("hf_cache") / "hub" / "models--acme--tiny-moe" / "snapshots" / SNAPSHOT_REV
    shutil.copytree(BUILTIN_MODELS["tiny-moe"], root)
    (root / "README.md").write_text("---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n\n# tiny-moe\n")
    return root


@pytest.fixture(scope="module")
def quantized(snapshot, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("push") / "tiny-mxfp4"
    _invoke("quantize", str(snapshot), "--scheme", "mxfp4", "--out", str(out), "--eval-tokens", "512")
    return out


def _report(directory: Path) -> dict:
    return json.loads((directory / "moecompress_report.json").read_text())


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def _expected_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file() and p.name != "README.md"}


def test_push_uploads_every_file_in_one_commit(quantized, hub, tmp_path):
    before = tree_hashes(quantized)
    env = {
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
    }
    result = run_cli("push", str(quantized), "--repo-id", "acme/tiny-moe-mxfp4", "--private", env=env)
    assert result.returncode == 0, result.stderr
    assert "pushed" in result.stdout and "acme/tiny-moe-mxfp4" in result.stdout

    creates = [r for r in hub.requests if r["path"] == "/api/repos/create"]
    assert [c["json"] for c in creates] == [
        {"name": "tiny-moe-mxfp4", "organization": "acme", "visibility": "private", "type": "model"}
    ]
    assert len(hub.commits) == 1 and hub.commits[0]["revision"] == "main"
    uploaded = hub.commits[0]["files"]
    expected = _expected_files(quantized)
    assert set(uploaded) == set(expected) | {"README.md"}
    assert all(uploaded[name] == data for name, data in expected.items())
    # the weights went through the LFS flow (batch, PUT of the exact bytes, verify), the rest inline
    weights = (quantized / "model.safetensors").read_bytes()
    assert any(r["method"] == "PUT" and r["body"] == weights for r in hub.requests)
    assert any(r["path"].endswith(".git/info/lfs/objects/batch") for r in hub.requests)

    card = uploaded["README.md"].decode()
    metadata = _front_matter(card)
    assert metadata["base_model"] == "acme/tiny-moe"
    assert metadata["base_model_relation"] == "quantized"
    assert metadata["library_name"] == "transformers"
    assert metadata["license"] == "apache-2.0"
    assert {"moe", "moecompress", "mxfp4", "quantized"} <= set(metadata["tags"])
    evaluation = _report(quantized)["eval"]
    for value in (evaluation["perplexity"], evaluation["reference_perplexity"]):
        assert f"{value:.3f}" in card
    assert f"{evaluation['kl']:.4f}" in card and f"{evaluation['routing_agreement']:.4f}" in card
    assert "import moecompress" in card and "```yaml" in card

    # (huggingface_hub itself also GETs /api/agent-harnesses, without a token; that is not part of the push)
    api_requests = [r for r in hub.requests if r["path"].startswith(("/api/repos/", "/api/models/", "/api/validate"))]
    assert len(api_requests) >= 4 and all(r["headers"].get("authorization") == f"Bearer {TOKEN}" for r in api_requests)
    for text in (result.stdout, result.stderr, card, *(data.decode("latin-1") for data in uploaded.values())):
        assert TOKEN not in text
    assert tree_hashes(quantized) == before


def test_push_to_a_revision_creates_the_branch(quantized, hub_env, capsys):
    args = ["push", str(quantized), "--repo-id", "acme/tiny-moe-mxfp4", "--revision", "mxfp4-rtn"]
    code, out, err = _main(capsys, *args)
    assert code == 0, err
    code, out, err = _main(capsys, *args)  # again: repo and branch exist now, which is fine
    assert code == 0, err
    assert TOKEN not in out + err
    creates = [r["json"] for r in hub_env.requests if r["path"] == "/api/repos/create"]
    assert creates[0] == {"name": "tiny-moe-mxfp4", "organization": "acme", "type": "model"}  # no visibility
    branches = [r for r in hub_env.requests if "/branch/" in r["path"]]
    assert [r["path"] for r in branches] == ["/api/models/acme/tiny-moe-mxfp4/branch/mxfp4-rtn"] * 2
    assert [c["revision"] for c in hub_env.commits] == ["mxfp4-rtn", "mxfp4-rtn"]
    repo = hub_env.repos["acme/tiny-moe-mxfp4"]
    assert repo["branches"]["main"] == {}
    assert set(repo["branches"]["mxfp4-rtn"]) == set(_expected_files(quantized)) | {"README.md"}


def test_dry_run_prints_card_and_files_and_sends_nothing(quantized, hub_env, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    before = tree_hashes(quantized)
    code, out, err = _main(capsys, "push", str(quantized), "--repo-id", "acme/tiny-moe-mxfp4", "--dry-run")
    assert code == 0, err
    assert hub_env.requests == []
    metadata = _front_matter(out)
    assert metadata["base_model"] == "acme/tiny-moe" and metadata["license"] == "apache-2.0"
    assert f"{_report(quantized)['eval']['perplexity']:.3f}" in out
    file_lines = out.split("--dry-run: would upload", 1)[1].splitlines()[1:]
    listed = {line.split()[2] for line in file_lines}
    assert listed == set(_expected_files(quantized)) | {"README.md"}
    # the source README was copied into the output; the card takes its place in the upload
    assert (quantized / "README.md").is_file() and "replacing the directory's README.md" in out
    assert tree_hashes(quantized) == before


def test_bad_inputs_are_one_line_errors_with_exit_2(quantized, hub_env, monkeypatch, tmp_path, capsys):
    def refused(fragment, *args):
        code, out, err = _main(capsys, "push", *args)
        assert code == 2, (out, err)
        assert len(err.strip().splitlines()) == 1 and fragment in err, err

    repo = ["--repo-id", "acme/tiny-moe-mxfp4"]
    for bad in ("tiny-moe", "acme/", "a/b/c", "acme/tiny moe", "acme/..x", "acme/x--y"):
        refused("--repo-id", str(quantized), "--repo-id", bad, "--dry-run")
    refused("--base-model", str(quantized), *repo, "--base-model", "not an id", "--dry-run")
    refused("no such directory", str(tmp_path / "missing"), *repo, "--dry-run")

    incomplete = tmp_path / "incomplete"
    shutil.copytree(quantized, incomplete)
    (incomplete / "MOECOMPRESS_INCOMPLETE").write_text("")
    refused("unfinished", str(incomplete), *repo, "--dry-run")
    no_report = tmp_path / "no_report"
    shutil.copytree(BUILTIN_MODELS["tiny-moe"], no_report)
    refused("not a moecompress output", str(no_report), *repo, "--dry-run")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(quantized, no_weights)
    (no_weights / "model.safetensors").unlink()
    refused("no .safetensors", str(no_weights), *repo, "--dry-run")

    monkeypatch.delenv("HF_TOKEN")
    refused("no Hugging Face token", str(quantized), *repo)
    assert hub_env.requests == []

    monkeypatch.setenv("HF_TOKEN", "hf_wrongtoken")
    refused("HTTP 401", str(quantized), *repo)
    assert hub_env.commits == []


def test_pruned_then_quantized_card_follows_the_chain(snapshot, tmp_path):
    from moecompress.hub import build_card

    pruned, chained = tmp_path / "pruned", tmp_path / "pruned-int4"
    _invoke("prune", str(snapshot), "--ratio", "0.25", "--calib-tokens", "1024", "--out", str(pruned),
            "--eval-tokens", "512")  # fmt: skip
    card = build_card(pruned, _report(pruned), repo_id="acme/tiny-moe-pruned")
    metadata = _front_matter(card.text)
    assert metadata["base_model"] == "acme/tiny-moe" and metadata["base_model_relation"] == "finetune"
    assert "expert-pruning" in metadata["tags"] and not card.warnings
    report = _report(pruned)
    assert f"| routed experts, all layers | {report['experts_before']} | {report['experts_after']} |" in card.text
    assert f"{report['eval']['perplexity']:.3f}" in card.text
    assert "import moecompress" not in card.text  # uniform pruning loads in stock transformers

    _invoke("quantize", str(pruned), "--scheme", "int4", "--out", str(chained), "--no-eval")
    card = build_card(chained, _report(chained), repo_id="acme/tiny-moe-pruned-int4")
    metadata = _front_matter(card.text)
    assert metadata["base_model"] == "acme/tiny-moe" and metadata["license"] == "apache-2.0"
    assert metadata["base_model_relation"] == "quantized"
    assert [step.name for step in card.steps] == ["prune_experts", "quantize"]
    recipe = yaml.safe_load(card.text.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert recipe["model"] == "acme/tiny-moe"
    assert recipe["passes"] == [{"prune_experts": report["config"]}, {"quantize": _report(chained)["config"]}]
    assert "perplexity" not in card.text.split("## Recipe")[0]  # --no-eval: no quality numbers, none invented


def test_unknown_base_model_is_left_out_with_a_warning(quantized, tmp_path):
    from moecompress.hub import build_card

    out = tmp_path / "builtin-int4"
    _invoke("quantize", "builtin:tiny-moe", "--scheme", "int4", "--out", str(out), "--no-eval")
    card = build_card(out, _report(out), repo_id="acme/x")
    metadata = _front_matter(card.text)
    assert "base_model" not in metadata and "base_model_relation" not in metadata and "license" not in metadata
    assert len(card.warnings) == 1 and "--base-model" in card.warnings[0]
    assert "builtin:tiny-moe" in card.text
    card = build_card(out, _report(out), repo_id="acme/x", base_model="acme/tiny-moe")
    assert _front_matter(card.text)["base_model"] == "acme/tiny-moe" and not card.warnings
