"""Reading raw execution logs: parsing a shard's lines into episodes and reading the logs at a DVC revision.

The record schema, its validation and ``Episode`` live in ``evoharness.data.records`` (re-exported here).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from evoharness.data.generic_log import parse_generic_lines
from evoharness.data.records import (  # noqa: F401  (re-exported)
    Episode,
    RawLogError,
    json_lines,
    validate_record,
    what_to_do,
)


def parse_lines(lines, source: str, quarantine: list | None = None) -> list[Episode]:
    """Decode and validate JSONL lines into episodes (steps must run 0, 1, 2, ... within an episode).

    With ``quarantine`` None, the first bad line raises RawLogError with ``source:line`` and the field. With a
    list, each bad line is appended to it as ``{"where", "error", "line"}`` and parsing goes on; an episode that
    lost a line is then incomplete, so its other lines are quarantined too (with the reason), never dropped
    silently.
    """
    episodes: dict[str, Episode] = {}
    broken: dict[str, str] = {}
    kept_lines: dict[str, list[tuple[str, str]]] = {}

    def bad(where: str, error: str, line: str, episode_id: str | None = None) -> None:
        if quarantine is None:
            raise RawLogError(error + what_to_do(where))
        quarantine.append({"where": where, "error": error, "line": line})
        if episode_id is not None:
            broken.setdefault(episode_id, where)

    for where, rec, line in json_lines(lines, source, bad):
        episode_id = rec.get("episode_id") if isinstance(rec, dict) else None
        try:
            validate_record(rec, where)
        except RawLogError as exc:
            bad(where, str(exc), line, episode_id if isinstance(episode_id, str) else None)
            continue
        if rec["episode_id"] in broken:
            quarantine.append({"where": where, "error": f"{where}: episode {rec['episode_id']!r} is incomplete "
                                                        f"(line {broken[rec['episode_id']]} was quarantined)",
                               "line": line})
            continue
        ep = episodes.setdefault(rec["episode_id"], Episode(rec["episode_id"], rec["game"], rec["task_type"], []))
        if rec["step"] != len(ep.records):
            bad(where, f"{where}: field 'step' is {rec['step']} but episode {rec['episode_id']!r} "
                       f"expects step {len(ep.records)}", line, rec["episode_id"])
            continue
        if rec["game"] != ep.game:
            bad(where, f"{where}: field 'game' is {rec['game']!r} but episode {rec['episode_id']!r} plays "
                       f"{ep.game!r}", line, rec["episode_id"])
            continue
        if ep.records and ep.records[-1]["done"]:
            bad(where, f"{where}: episode {rec['episode_id']!r} already ended (done) at step "
                       f"{len(ep.records) - 1}", line, rec["episode_id"])
            continue
        ep.records.append(rec)
        kept_lines.setdefault(rec["episode_id"], []).append((where, line))
    for episode_id, ep in list(episodes.items()):
        if episode_id not in broken and not ep.records[-1]["done"] and "error" not in ep.records[-1]:
            where = kept_lines[episode_id][-1][0]
            bad(where, f"{where}: episode {episode_id!r} ends at step {len(ep.records) - 1} without done "
                       f"(a truncated log?)", kept_lines[episode_id][-1][1], episode_id)
            kept_lines[episode_id].pop()
    for episode_id, first_bad in broken.items():
        for where, line in kept_lines.pop(episode_id, []):
            quarantine.append({"where": where, "error": f"{where}: episode {episode_id!r} is incomplete "
                                                        f"(line {first_bad} was quarantined)", "line": line})
        episodes.pop(episode_id, None)
    return list(episodes.values())


def dvc_md5(repo: str | Path, rev: str | None = None, dvc_file: str = "data.dvc") -> str | None:
    """The data's DVC md5 (``outs[0].md5`` of ``data.dvc``) in the workspace or at git ``rev``; None if absent."""
    repo = Path(repo)
    if rev is None:
        path = repo / dvc_file
        if not path.exists():
            return None
        text = path.read_text()
    else:
        import subprocess

        proc = subprocess.run(["git", "show", f"{rev}:{dvc_file}"], cwd=repo, capture_output=True, text=True)
        if proc.returncode != 0:
            raise FileNotFoundError(f"{dvc_file} not found at rev {rev!r} in {repo}: {proc.stderr.strip()}")
        text = proc.stdout
    return yaml.safe_load(text)["outs"][0]["md5"]


def read_episodes(repo: str | Path, rev: str | None = None, path: str = "data/logs",
                  quarantine: list | None = None) -> tuple[list[Episode], str]:
    """Read and validate every shard under ``path`` through ``dvc.api`` at git ``rev`` (None = workspace).

    ``path`` is ``<tracked folder>/logs``; the folder's ``.dvc`` file (``data.dvc`` for ``data/logs``) names the md5.
    Shards named ``*.generic.jsonl`` hold one episode per line in the generic format (``generic_log``); the
    others hold the records above.
    Returns (episodes, md5) where md5 is the data's DVC md5 at that rev. ``quarantine``: see ``parse_lines``.
    Raises RawLogError on a bad record (unless quarantining); FileNotFoundError when the rev's data is not in the
    DVC cache/remote.
    """
    from dvc.api import DVCFileSystem

    fs = DVCFileSystem(str(repo), rev=rev)
    try:
        shards = sorted(p for p in fs.find(path) if p.endswith(".jsonl"))
    except FileNotFoundError:
        shards = []
    except Exception as exc:  # DVC's own errors (e.g. DataIndexDirError when the cache lacks the listing)
        raise FileNotFoundError(f"{path}/ at rev {rev or 'workspace'} could not be listed through DVC "
                                f"({type(exc).__name__}: {exc}); run `dvc pull` or re-run collection") from exc
    if not shards:
        raise FileNotFoundError(f"no raw logs under {path}/ in {repo} at rev {rev or 'workspace'}")
    episodes: list[Episode] = []
    for shard in shards:
        try:
            with fs.open(shard, "r") as fh:
                lines = fh.read().splitlines()
        except Exception as exc:
            raise FileNotFoundError(f"{shard} at rev {rev or 'workspace'} could not be read through DVC "
                                    f"({type(exc).__name__}: {exc}); run `dvc pull` or re-run collection") from exc
        if shard.endswith(".generic.jsonl"):  # any tool-using agent's episodes: see evoharness/data/generic_log.py

            episodes.extend(parse_generic_lines(lines, shard, quarantine))
        else:
            episodes.extend(parse_lines(lines, shard, quarantine))
    md5 = dvc_md5(repo, rev, f"{Path(path).parent}.dvc")
    return episodes, md5 or ""


def dagger_policy(repo: str | Path, data_rev: str | None, path: str) -> str:
    """The policy whose states ``<path>/`` holds (its ``dagger-*.json`` manifest, read through DVC at ``data_rev``);
    ``unknown`` when the folder has no manifest."""
    from dvc.api import DVCFileSystem

    fs = DVCFileSystem(str(repo), rev=data_rev)
    for name in sorted(p for p in fs.find(path, maxdepth=1) if Path(p).name.startswith("dagger-")
                       and p.endswith(".json")):
        with fs.open(name, "r") as fh:
            return json.load(fh)["settings"]["policy"]
    return "unknown"

