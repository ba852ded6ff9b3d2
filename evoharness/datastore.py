"""The DVC-versioned raw logs: make sure ``data/`` holds the version ``data.dvc`` names, or create it.

``ensure_data`` is the collect stage's logic:
- ``data/logs`` already holds shards: use them if their md5 is the one ``data.dvc`` names, else raise (a hand
  edit is never recorded as a new version behind the user's back);
- ``data.dvc`` exists: check the data out of the DVC cache; when no cache or remote holds it (a fresh clone),
  regenerate it with the profile's collection settings (collection is deterministic) and require the md5 to match
  ``data.dvc``; a mismatch restores ``data.dvc`` and raises, never a silent new version;
- neither: collect, then ``dvc add data``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from evoharness.collect import collect
from evoharness.config import CollectConfig
from evoharness.rawlog import dvc_md5


class DataVersionMismatch(RuntimeError):
    """Regenerated logs differ from the version ``data.dvc`` names."""


def _quiet_env() -> None:
    os.environ.setdefault("DVC_NO_ANALYTICS", "1")


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
    return dvc_md5(repo)


def _has_logs(data: Path) -> bool:
    return any((data / "logs").glob("shard-*.jsonl"))


def ensure_data(repo: str | Path, cfg: CollectConfig, games: list[str], data_dir: str | None = None,
                progress=None) -> dict:
    """Make ``repo/data`` hold the raw logs (see module docstring). Returns ``{"status", "md5", "manifest"}``.

    Raises DataVersionMismatch when regenerated logs do not match ``data.dvc``.
    """
    repo = Path(repo)
    data = repo / "data"
    ensure_dvc_repo(repo)
    committed = dvc_md5(repo)
    if _has_logs(data):
        if not committed:
            return {"status": "added", "md5": dvc_add(repo), "manifest": None}
        dvc_text = (repo / "data.dvc").read_text()
        md5 = dvc_add(repo)  # cheap when unchanged: DVC caches file hashes
        if md5 != committed:
            (repo / "data.dvc").write_text(dvc_text)
            raise DataVersionMismatch(
                f"{data} holds logs with md5 {md5}, not the version data.dvc names ({committed}). Restore it with "
                f"`dvc checkout data`, or make it a new version on purpose with `dvc add data` and a commit of "
                f"data.dvc. data.dvc was left unchanged.")
        return {"status": "present", "md5": md5, "manifest": None}
    if committed:
        from dvc.exceptions import CheckoutError
        from dvc.repo import Repo

        try:
            with Repo(str(repo)) as r:
                r.checkout(targets=[str(repo.resolve() / "data.dvc")])
            if _has_logs(data):
                return {"status": "checked_out", "md5": committed, "manifest": None}
        except CheckoutError:
            pass  # no cache holds it: regenerate below
    dvc_text = (repo / "data.dvc").read_text() if committed else None
    if data.exists():
        shutil.rmtree(data)
    manifest = collect(games, data, cfg, data_dir, progress)
    md5 = dvc_add(repo)
    if committed and md5 != committed:
        (repo / "data.dvc").write_text(dvc_text)
        aside = repo / f"data.mismatch-{md5.removesuffix('.dir')[:12]}"
        shutil.rmtree(aside, ignore_errors=True)
        data.rename(aside)
        raise DataVersionMismatch(
            f"data.dvc names md5 {committed} but the logs regenerated with profile settings {manifest['settings']} "
            f"have md5 {md5}. The committed data version was made with other collection settings: run with the "
            f"profile that made it, restore data/ from a DVC cache or remote (dvc pull), or commit a new "
            f"data.dvc on purpose. data.dvc was left unchanged; the regenerated logs were moved to {aside}.")
    return {"status": "regenerated" if committed else "collected", "md5": md5, "manifest": manifest}
