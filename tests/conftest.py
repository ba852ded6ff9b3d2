"""Shared fixtures: offline settings, a temporary git+DVC repo, and a small real collection reused by tests."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import tempfile

import pytest

for key, value in {"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "DVC_NO_ANALYTICS": "1",
                   "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                   "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "OMP_NUM_THREADS": "1",
                   "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90"}.items():
    os.environ.setdefault(key, value)
# Prefect's cache records and persisted results of this session stay out of the repo's runs/
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = tempfile.mkdtemp(prefix="evoharness-prefect-results-")

from evoharness.config import CollectConfig  # noqa: E402
from evoharness.data.collect import collect  # noqa: E402
from evoharness.env.alfworld import list_games  # noqa: E402


def git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def make_git_repo(repo):
    """An empty git repository with one commit at ``repo`` (DVC needs git)."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "test@example.com")
    git(repo, "config", "user.name", "test")
    git(repo, "commit", "-q", "--allow-empty", "-m", "init")
    return repo


@pytest.fixture
def git_repo(tmp_path):
    return make_git_repo(tmp_path / "repo")


TINY_COLLECT = CollectConfig(num_games=3, stride=1100, perturb_share=0.34, workers=1, max_steps=50)


@pytest.fixture(scope="session")
def tiny_games():
    """Three real train games of different task types."""
    return list_games("train", limit=TINY_COLLECT.num_games, stride=TINY_COLLECT.stride)


@pytest.fixture(scope="session")
def tiny_logs(tmp_path_factory, tiny_games):
    """Raw logs of the three games, collected once per session with the real handcoded expert."""
    out = tmp_path_factory.mktemp("logs") / "data"
    manifest = collect(tiny_games, out, TINY_COLLECT)
    return out, manifest


def pytest_sessionfinish(session, exitstatus):
    """Stop Prefect's temporary API server (started by the first flow run) while pytest still holds the output:
    at interpreter exit its goodbye line would hit a closed stream and print a 'Logging error' traceback."""
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer

    # A child process a test left running (a hung worker) would block interpreter exit in multiprocessing's
    # join-at-exit, so the suite would never end: kill it and say which.
    for child in multiprocessing.active_children():
        print(f"\nkilled a process a test left running: {child.name} (pid {child.pid})")
        child.kill()
    APILogWorker.drain_all(timeout=5)  # the flow runs' last log lines reach the server before it stops
    for server in list(SubprocessASGIServer._instances.values()):
        server.stop()
