"""The DVC-versioned raw logs: make sure the tracked folder holds the version its ``.dvc`` file names, or create it.

The folder is ``CollectConfig.path`` (``data`` with ``data.dvc`` for the default profile, ``data-full`` with
``data-full.dvc`` for ``full``). ``ensure_data`` is the collect stage's logic:
- ``<path>/logs`` already holds shards: use them if their md5 is the one ``<path>.dvc`` names, else raise (a hand
  edit is never recorded as a new version behind the user's back);
- ``<path>.dvc`` exists: check the data out of the DVC cache, else pull it from the default DVC remote; when
  neither holds it (a fresh clone on a fresh machine), regenerate it with the profile's collection settings
  (collection is deterministic) and require the md5 to match; a mismatch restores the ``.dvc`` file and raises,
  never a silent new version;
- neither: collect, then ``dvc add <path>``.
Whenever a default remote is configured (``.dvc/config``: ``remote = local``, a directory outside the repo), the
version is then pushed there (``dvc push``), so another clone on this machine pulls it instead of regenerating.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from evoharness.config import CollectConfig
from evoharness.data.collect import collect
from evoharness.data.rawlog import dvc_md5


class DataVersionMismatch(RuntimeError):
    """Regenerated logs differ from the version ``data.dvc`` names."""


def _quiet_env() -> None:
    os.environ.setdefault("DVC_NO_ANALYTICS", "1")
    # `dvc add` tells a CLI user to `git add` the .dvc file (at INFO, every run, even when unchanged): the pipeline's
    # summary names the md5 and committing the .dvc file is the user's release step, so the hint is noise here
    logging.getLogger("dvc.repo.scm_context").setLevel(logging.WARNING)


def ensure_dvc_repo(repo: str | Path) -> None:
    """``dvc init`` (analytics and update checks off) unless ``repo`` is already a DVC repo; needs git.

    Raises RuntimeError when ``repo`` is not a git work tree.
    """
    _quiet_env()
    repo = Path(repo)
    if (repo / ".dvc").is_dir():
        return
    if subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=repo, capture_output=True).returncode:
        raise RuntimeError(f"{repo} is not a git repository: DVC versioning of data/ needs one (git init)")
    from dvc.repo import Repo

    Repo.init(str(repo))
    with Repo(str(repo)).config.edit() as conf:
        conf["core"]["analytics"] = False
        conf["core"]["check_update"] = False


def dvc_add(repo: str | Path, target: str = "data") -> str:
    """``dvc add target``; returns the new md5 of ``target.dvc``."""
    _quiet_env()
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        r.add(str(Path(repo).resolve() / target))
    return dvc_md5(repo, dvc_file=f"{target}.dvc")


def add_checked(repo: str | Path, target: str, committed: str | None, what: str, advice: str,
                aside: bool = False) -> str:
    """``dvc add target`` and return its md5, holding it to the version ``<target>.dvc`` names (``committed``; None:
    no version yet, any md5 is the new one). On a mismatch ``<target>.dvc`` is put back as it was (a version is
    never replaced behind the user's back), the folder is moved to ``<target>.mismatch-<md5>`` when ``aside``, and
    DataVersionMismatch is raised naming both md5s, ``what`` holds the other one, and ``advice``."""
    repo = Path(repo)
    dvc_file = repo / f"{target}.dvc"
    dvc_text = dvc_file.read_text() if committed else None
    md5 = dvc_add(repo, target)
    if committed is None or md5 == committed:
        return md5
    dvc_file.write_text(dvc_text)
    moved = ""
    if aside:
        dest = repo / f"{target}.mismatch-{md5.removesuffix('.dir')[:12]}"
        shutil.rmtree(dest, ignore_errors=True)
        (repo / target).rename(dest)
        moved = f"; the logs were moved to {dest}"
    raise DataVersionMismatch(f"{dvc_file.name} names md5 {committed}, but {what} has md5 {md5}. {advice} "
                              f"{dvc_file.name} was left unchanged{moved}.")


def default_remote(repo: str | Path) -> str | None:
    """The URL of the repo's default DVC remote (``core.remote``), or None when none is configured."""
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        name = r.config["core"].get("remote")
        return r.config["remote"][name]["url"] if name else None


def dvc_push(repo: str | Path, target: str = "data") -> int:
    """``dvc push <target>.dvc`` to the default remote; returns the number of files transferred (0: already there).

    Raises RuntimeError naming the remote and what to do when the push fails."""
    _quiet_env()
    from dvc.repo import Repo

    url = default_remote(repo)
    try:
        with Repo(str(repo)) as r:
            return r.push(targets=[str(Path(repo).resolve() / f"{target}.dvc")])
    except Exception as exc:
        raise RuntimeError(f"dvc push of {target} to the default remote {url!r} failed ({type(exc).__name__}: "
                           f"{exc}). Check that the directory exists and is writable, or point the remote "
                           f"elsewhere: `dvc remote modify --local local url /path/outside/repo`.") from exc


def _pull(repo: Path, target: str) -> bool:
    """Fetch ``target`` from the default remote into the cache and check it out; False when the remote lacks it."""
    if not default_remote(repo):
        return False
    from dvc.repo import Repo

    try:
        with Repo(str(repo)) as r:
            r.pull(targets=[str(repo.resolve() / f"{target}.dvc")])
    except Exception:  # remote folder missing or without this version: the caller regenerates
        return False
    return _has_logs(repo / target)


def restore(repo: str | Path, target: str) -> bool:
    """Bring back the version ``<target>.dvc`` names into ``<target>/``: check it out of the DVC cache, else pull it
    from the default remote. Returns whether ``<target>/logs`` then holds shards (any ``*.jsonl``)."""
    from dvc.exceptions import CheckoutError
    from dvc.repo import Repo

    repo = Path(repo)
    try:
        with Repo(str(repo)) as r:
            r.checkout(targets=[str(repo.resolve() / f"{target}.dvc")])
    except CheckoutError:
        _pull(repo, target)
    return any((repo / target / "logs").glob("*.jsonl"))


def _has_logs(data: Path) -> bool:
    return any((data / "logs").glob("shard-*.jsonl"))


def ensure_data(repo: str | Path, cfg: CollectConfig, games: list[str], data_dir: str | None = None,
                progress=None, push: bool = True) -> dict:
    """Make ``repo/<cfg.path>`` hold the raw logs (see module docstring).

    Returns ``{"status", "md5", "manifest", "pushed"}``: status is present, added, checked_out, pulled, regenerated
    or collected; ``pushed`` is the number of files ``dvc push`` sent (None when no default remote is configured
    or ``push`` is false) and ``push_error`` the reason a push failed (the data is then only in the local cache; the
    next run pushes again). Raises DataVersionMismatch when regenerated logs do not match the ``.dvc`` file.
    """
    repo = Path(repo)
    out = _ensure(repo, cfg, games, data_dir, progress)
    out["pushed"] = None
    if push and default_remote(repo):
        try:
            out["pushed"] = dvc_push(repo, cfg.path)
        except RuntimeError as exc:  # the version is committed locally either way; the next run pushes again
            out["push_error"] = str(exc)
    return out


def _ensure(repo: Path, cfg: CollectConfig, games: list[str], data_dir: str | None, progress) -> dict:
    target = cfg.path
    data, dvc_file = repo / target, repo / f"{target}.dvc"
    ensure_dvc_repo(repo)
    committed = dvc_md5(repo, dvc_file=dvc_file.name)
    if _has_logs(data):
        if not committed:
            return {"status": "added", "md5": dvc_add(repo, target), "manifest": None}
        md5 = add_checked(  # cheap when unchanged: DVC caches file hashes
            repo, target, committed, f"{data}/ (the logs there now)",
            f"Restore it with `dvc checkout {target}`, or make it a new version on purpose with `dvc add {target}` "
            f"and a commit of {dvc_file.name}.")
        return {"status": "present", "md5": md5, "manifest": None}
    if committed:
        from dvc.exceptions import CheckoutError
        from dvc.repo import Repo

        try:
            with Repo(str(repo)) as r:
                r.checkout(targets=[str(dvc_file.resolve())])
            if _has_logs(data):
                return {"status": "checked_out", "md5": committed, "manifest": None}
        except CheckoutError:
            pass  # no cache holds it: pull, else regenerate below
        if _pull(repo, target):
            return {"status": "pulled", "md5": committed, "manifest": None}
    if data.exists():
        shutil.rmtree(data)
    manifest = collect(games, data, cfg, data_dir, progress)
    md5 = add_checked(
        repo, target, committed, f"the logs regenerated with profile settings {manifest['settings']}",
        f"The committed data version was made with other collection settings or another expert (its manifest's "
        f"settings.expert; none before 2026-12-02): run with the profile that made it, restore {target}/ from a DVC "
        f"cache or remote (dvc pull), or commit a new {dvc_file.name} on purpose.", aside=True)
    return {"status": "regenerated" if committed else "collected", "md5": md5, "manifest": manifest}
