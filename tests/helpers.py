"""Small helpers several test modules share."""

import hashlib
import os
import subprocess
import sys


def run_cli(*args, env=None):
    """Run the real console entry point in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "moecompress.cli.main", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def tree_hashes(directory):
    """SHA-256 of every file directly inside ``directory``."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}
