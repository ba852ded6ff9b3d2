"""Data versions pinned to a git rev: make the DVC cache hold the raw logs a rev's ``.dvc`` file names, on any
machine.

A pipeline pinned with ``--data-rev REV`` reads the logs ``<path>.dvc`` names at REV (``rawlog.read_episodes``
through ``dvc.api``), never the workspace's. ``ensure_version_at`` makes that read possible: the version is already
in the local DVC cache; else it is fetched from the default remote; else (a fresh clone on a fresh machine, no
remote) it is regenerated with REV's own collection code and settings, in a temporary git worktree at REV whose DVC
cache is this repository's, and its md5 is checked against REV's ``.dvc`` file. Collection is deterministic
(``evoharness.data.collect``), so the same code and settings give the same bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from evoharness.data.rawlog import dvc_md5


class DataVersionUnavailable(RuntimeError):
    """No cache, remote or regeneration could produce the data version a rev names."""


def _cache_dir(repo: Path) -> Path:
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        return Path(r.cache.local.path)  # <cache dir>/files/md5


def in_cache(repo: str | Path, md5: str) -> bool:
    """Whether the local DVC cache of ``repo`` holds the directory version ``md5`` (``<hash>.dir``) and every file it
    lists."""
    objects = _cache_dir(Path(repo))

    def path(oid: str) -> Path:
        return objects / oid[:2] / oid[2:]

    listing = path(md5)
    if not listing.exists():
        return False
    try:
        entries = json.loads(listing.read_text())
    except (OSError, ValueError):
        return False
    return all(path(e["md5"]).exists() for e in entries)


def remote_state(repo: str | Path) -> tuple[str | None, bool]:
    """(URL of the default DVC remote or None, whether it is a local folder that exists; True for other URLs)."""
    from evoharness.data.datastore import default_remote

    url = default_remote(repo)
    if url is None:
        return None, False
    if "://" in url:
        return url, True
    local = Path(url) if Path(url).is_absolute() else (Path(repo) / ".dvc" / url).resolve()
    return url, local.is_dir()


def read_failure_hint(repo: str | Path, rev: str | None, target: str) -> str:
    """What a failed read of ``<target>/`` at ``rev`` through DVC should tell the user: the md5 the rev's
    ``<target>.dvc`` names, whether the local cache (and which folder) holds it, and the default remote (and whether
    it exists), with the next step. Never raises: a part it cannot find is said as unknown."""
    try:
        md5 = dvc_md5(repo, rev, f"{target}.dvc")
    except Exception:
        md5 = None
    if not md5:
        return f"{target}.dvc names no version at rev {rev or 'workspace'}: collect the data (make collect) first."
    try:
        cache = str(_cache_dir(Path(repo)).parent.parent)
        cached = "holds it" if in_cache(repo, md5) else "does not hold it"
    except Exception:
        cache, cached = "unknown", "unknown"
    try:
        url, exists = remote_state(repo)
    except Exception:
        url, exists = None, False
    remote = ("no default DVC remote is configured" if url is None
              else f"default remote {url} ({'exists' if exists else 'does not exist on this machine'})")
    point = ("`dvc remote add -d store PATH_OR_URL`" if url is None
             else "`dvc remote modify --local NAME url PATH_OR_URL` (NAME: `dvc remote list`)")
    return (f"{target}.dvc at rev {rev or 'workspace'} names md5 {md5}; the DVC cache {cache} {cached}; {remote}. "
            f"Point a remote at the store that has it ({point}) and `dvc pull {target}`, or re-run the collect stage "
            f"(it regenerates a pinned version with that rev's code).")


def _fetch(repo: Path, rev: str, target: str) -> bool:
    from dvc.repo import Repo

    try:
        with Repo(str(repo)) as r:
            r.fetch(targets=[f"{target}.dvc"], revs=[rev], workspace=False)
    except Exception:  # remote missing or without this version: regenerate
        return False
    return True


def regenerate_at(repo: str | Path, rev: str, profile: str, timeout_s: float = 6 * 3600) -> None:
    """Run ``python -m flows.collect --profile <profile>`` of git ``rev`` in a temporary worktree at ``rev`` whose DVC
    cache is ``repo``'s, so the version that rev's code and settings collect lands in ``repo``'s cache (and its
    default remote, when that rev's collection pushes). The rev's own collection checks the md5 against its ``.dvc``
    file. Raises DataVersionUnavailable with the command's last output lines when it fails."""
    repo = Path(repo).resolve()
    paths = (f"profiles/{profile}.yaml", f"profiles/experiments/{profile}.yaml")
    if not any(subprocess.run(["git", "cat-file", "-e", f"{rev}:{p}"], cwd=repo, capture_output=True).returncode == 0
               for p in paths):
        raise DataVersionUnavailable(f"rev {rev} has no profile {profile!r} ({' or '.join(paths)}), so its "
                                     f"`python -m flows.collect --profile {profile}` cannot run; name the profile "
                                     "that made the data with --profile")
    cache = _cache_dir(repo).parent.parent  # the cache dir, above files/md5
    with tempfile.TemporaryDirectory(prefix="evoharness-rev-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), rev], cwd=repo, check=True,
                       capture_output=True)
        try:
            subprocess.run([sys.executable, "-m", "dvc", "config", "--local", "cache.dir", str(cache)], cwd=tree,
                           check=True, capture_output=True)
            from evoharness.registry.tracking import USER_TRACKING_URI

            # the rev's collect run goes to this repository's MLflow store, not the worktree's (deleted below)
            env = os.environ | {"PYTHONPATH": str(tree), "MLFLOW_TRACKING_URI": USER_TRACKING_URI
                                or f"sqlite:///{repo / 'mlflow' / 'mlflow.db'}"}
            proc = subprocess.run([sys.executable, "-m", "flows.collect", "--profile", profile], cwd=tree, env=env,
                                  capture_output=True, text=True, timeout=timeout_s)
            if proc.returncode:
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
                raise DataVersionUnavailable(
                    f"regenerating the data of rev {rev} with its `python -m flows.collect --profile {profile}` "
                    f"failed (exit {proc.returncode}):\n{tail}")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=repo, capture_output=True)


def ensure_version_at(repo: str | Path, rev: str, target: str, profile: str, regenerate: bool = True) -> dict:
    """Make ``repo``'s DVC cache hold the version ``<target>.dvc`` names at git ``rev`` (see the module docstring).

    ``profile``: the profile whose collection settings made that version, read at ``rev``. Returns
    ``{"status", "md5"}``: status ``cached``, ``pulled`` or ``regenerated``. The workspace's ``<target>/`` is not
    touched. Raises DataVersionUnavailable naming the md5, the remote tried (and whether it exists) and what to do
    when ``rev`` has no ``<target>.dvc``, or no cache, remote or regeneration yields the version.
    """
    repo = Path(repo)
    try:
        md5 = dvc_md5(repo, rev, f"{target}.dvc")
    except FileNotFoundError as exc:
        raise DataVersionUnavailable(f"{exc}. Pin a rev that tracks {target}/ (`git log -- {target}.dvc`).") from exc
    if in_cache(repo, md5):
        return {"status": "cached", "md5": md5}
    url, exists = remote_state(repo)
    if url and exists and _fetch(repo, rev, target) and in_cache(repo, md5):
        return {"status": "pulled", "md5": md5}
    where = (f"the default DVC remote {url!r} ({'exists but lacks it' if exists else 'does not exist here'})"
             if url else "no default DVC remote (none configured)")
    advice = (f"Point the remote at a store that holds it (`dvc remote modify --local {_remote_name(repo)} url "
              f"<s3://..., ssh://..., /shared/folder>`, see docs/operations.md) and re-run, or regenerate it: "
              f"check out {rev} and run `python -m flows.collect --profile {profile}` there.")
    if not regenerate:
        raise DataVersionUnavailable(f"{target} md5 {md5} (rev {rev}) is not in the local DVC cache and {where}. "
                                     + advice)
    try:
        regenerate_at(repo, rev, profile)
    except DataVersionUnavailable as exc:
        raise DataVersionUnavailable(f"{target} md5 {md5} (rev {rev}) is not in the local DVC cache, {where}, and "
                                     f"{exc}\n{advice}") from exc
    if not in_cache(repo, md5):
        raise DataVersionUnavailable(
            f"{target} md5 {md5} (rev {rev}): the rev's collection with profile {profile!r} ran but did not put that "
            f"version in the cache (another profile made it?). {advice}")
    return {"status": "regenerated", "md5": md5}


def _remote_name(repo: Path) -> str:
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        return r.config["core"].get("remote") or "<name>"
