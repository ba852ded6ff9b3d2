"""A rerun pinned to an older data version on a fresh clone with no DVC cache and no reachable remote: the version
is regenerated with that rev's own collection code and settings and read at the rev (evoharness.data.pinned)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import git, make_git_repo
from evoharness.config import CollectConfig
from evoharness.data.collect import profile_games
from evoharness.data.datastore import ensure_data
from evoharness.data.pinned import DataVersionUnavailable, ensure_version_at, in_cache
from evoharness.data.rawlog import dvc_md5, read_episodes

pytestmark = pytest.mark.slow  # three collections and a flow run in a worktree

ROOT = Path(__file__).resolve().parent.parent
CODE = ("evoharness", "tasks", "flows", "accelerate", "pyproject.toml")


def pin_profile(num_games: int) -> tuple[str, CollectConfig]:
    cfg = CollectConfig(split="train", num_games=num_games, stride=1100, perturb_share=0.0, workers=1, max_steps=50,
                        path="data-pin")
    text = (f"collect:\n  split: train\n  num_games: {num_games}\n  stride: 1100\n  perturb_share: 0.0\n"
            "  workers: 1\n  max_steps: 50\n  path: data-pin\n")
    return text, cfg


def commit_version(proj: Path, num_games: int) -> tuple[str, str]:
    """Collect the `pin` profile's logs at ``num_games`` as a new data version and commit it with the profile."""
    text, cfg = pin_profile(num_games)
    (proj / "profiles" / "pin.yaml").write_text(text)
    shutil.rmtree(proj / "data-pin", ignore_errors=True)
    (proj / "data-pin.dvc").unlink(missing_ok=True)
    out = ensure_data(proj, cfg, profile_games(cfg), push=False)
    git(proj, "add", "-A")
    git(proj, "commit", "-q", "-m", f"data-pin: {num_games} games")
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=proj, capture_output=True, text=True).stdout.strip()
    return rev, out["md5"]


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """A project repository (this checkout's code) with two committed versions of data-pin, its remote a folder
    that never existed; then a fresh clone of it (no DVC cache)."""
    base = tmp_path_factory.mktemp("pinned")
    proj = make_git_repo(base / "proj")
    for name in CODE:
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, proj / name)
    shutil.rmtree(proj / "evoharness" / "__pycache__", ignore_errors=True)
    (proj / "profiles").mkdir()
    (proj / ".gitignore").write_text("__pycache__/\n/mlflow/\n/runs/\n")
    from evoharness.data.datastore import ensure_dvc_repo

    ensure_dvc_repo(proj)
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "-d", "store", str(base / "gone")], cwd=proj, check=True,
                   capture_output=True)
    old = commit_version(proj, 1)
    new = commit_version(proj, 2)
    fresh = base / "fresh"
    subprocess.run(["git", "clone", "-q", str(proj), str(fresh)], check=True)
    return {"proj": proj, "fresh": fresh, "old": old, "new": new}


def test_an_old_version_is_regenerated_with_its_revs_code_and_read_at_that_rev(versions):
    fresh, (rev, md5) = versions["fresh"], versions["old"]
    assert md5 != versions["new"][1] and not in_cache(fresh, md5)
    out = ensure_version_at(fresh, rev, "data-pin", "pin")
    assert out == {"status": "regenerated", "md5": md5}
    episodes, read_md5 = read_episodes(fresh, rev, "data-pin/logs")
    assert read_md5 == md5 and len(episodes) == 1
    assert not (fresh / "data-pin").exists()  # the workspace's version is not touched
    assert subprocess.run(["git", "worktree", "list"], cwd=fresh, capture_output=True,
                          text=True).stdout.count("\n") == 1  # the temporary worktree is gone
    assert ensure_version_at(fresh, rev, "data-pin", "pin") == {"status": "cached", "md5": md5}
    assert (versions["proj"].parent / "gone").is_dir()  # the rev's collection pushed it: the next clone pulls it
    assert dvc_md5(fresh, rev, "data-pin.dvc") == md5


def test_a_version_nothing_can_produce_is_named_with_the_remote_and_what_to_do(versions):
    fresh, (rev, md5) = versions["fresh"], versions["new"]
    shutil.rmtree(versions["proj"].parent / "gone", ignore_errors=True)  # a regeneration pushes there: remove it
    with pytest.raises(DataVersionUnavailable) as err:
        ensure_version_at(fresh, rev, "data-pin", "pin", regenerate=False)
    text = str(err.value)
    assert md5 in text and rev in text and "does not exist here" in text and str(versions["proj"].parent / "gone") \
        in text and "dvc remote modify --local store url" in text
    with pytest.raises(DataVersionUnavailable) as err:  # the rev has no such profile: its collection fails
        ensure_version_at(fresh, rev, "data-pin", "no-such-profile")
    assert md5 in str(err.value) and "has no profile 'no-such-profile'" in str(err.value)
    with pytest.raises(DataVersionUnavailable, match="data-other.dvc not found at rev"):
        ensure_version_at(fresh, rev, "data-other", "pin")


def test_a_failed_read_names_the_version_the_cache_and_the_remote(versions):
    """The ingest stage's message when DVC cannot read a pinned rev's logs (tasks.data.ingest_task adds the hint)."""
    from evoharness.data.pinned import read_failure_hint

    fresh, (rev, md5) = versions["fresh"], versions["new"]
    shutil.rmtree(versions["proj"].parent / "gone", ignore_errors=True)
    with pytest.raises(FileNotFoundError, match=f"at rev {rev}.*dvc pull"):
        read_episodes(fresh, rev, "data-pin/logs")
    hint = read_failure_hint(fresh, rev, "data-pin")
    assert f"names md5 {md5}" in hint and "does not hold it" in hint
    assert f"{versions['proj'].parent / 'gone'} (does not exist on this machine)" in hint
    assert "dvc remote modify --local NAME url" in hint and "dvc pull data-pin" in hint
