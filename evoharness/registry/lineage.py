"""Audit a registered policy: model version -> runs -> trace hash -> data rev -> raw logs, verified through DVC.

    python -m evoharness.registry.lineage models:/evoharness-policy@champion [--repo PATH]

Prints the chain, checks that the raw logs still resolve through DVC at the recorded rev and that their md5 is
the recorded one, and shows how the model's harness use differs from its parent's (meta-actions per episode by
type and by task type, from their evaluations on the same games). Exits 1 with a message naming what failed and
what to do when the data does not resolve or does not match; 2 when the model URI cannot be resolved.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from evoharness.harness.workspace import META_ACTIONS


class LineageError(RuntimeError):
    """The recorded lineage does not verify."""


def pipeline_lineage(*, data_rev: str | None, md5: str, data_path: str, dagger_policies: dict, traces: dict,
                     sft: dict, grpo: dict | None, start: dict | None, sft_model: str | None, until: str,
                     config_digest: str, pipeline_run_id: str, run_tags: dict) -> dict:
    """The lineage tags of a policy the pipeline trained, the keys ``audit`` walks back.

    Args:
        data_rev: the git rev the logs were read at (None: the workspace). md5, data_path: the DVC md5(s) and
            folder(s) (``a+b`` for aggregated DAgger data); dagger_policies: ``{folder: policy that played it}``.
        traces, sft, grpo: the stages' results (``content_hash``/``run_id``; ``run_id``/``model_uri``/``base_model``;
            ``run_id`` or None after ``--until sft``). start: the champion or release the run retrained
            (``model_uri``, ``source``), or None. sft_model: the ``--sft-model`` GRPO started from, or None.
        run_tags: the pipeline run's tags (``git_commit``, ``git_dirty``, ``profile``, Prefect ids).

    Returns a flat ``{tag: str}`` dict (``data_rev``, ``dvc_md5``, ``trace_hash``, ``parent_model_run_id``,
    ``parent_model_uri`` when the run started from a model, ``config_digest``, ``git_commit``, ...).
    Raises KeyError when ``run_tags`` lacks one of the pipeline run's tags."""
    lineage = {"data_rev": data_rev or "workspace", "dvc_md5": md5, "data_path": data_path,
               **{f"dagger_policy.{k}": v for k, v in dagger_policies.items()},
               "trace_hash": traces["content_hash"], "trace_run_id": traces["run_id"],
               "parent_model_run_id": sft["run_id"], "trained_until": until, "pipeline_run_id": pipeline_run_id,
               "config_digest": config_digest}
    if sft_model:
        lineage["parent_model_uri"] = sft["model_uri"]
    if start:
        lineage |= {"parent_model_uri": start["model_uri"], "started_from": start["source"]}
    if sft.get("base_model"):
        lineage["base_model"] = sft["base_model"]
    if grpo:
        lineage["grpo_run_id"] = grpo["run_id"]
    return lineage | {k: run_tags[k] for k in ("git_commit", "git_dirty", "profile", "prefect_flow_run_id",
                                               "prefect_deployment_id")}


def _run_summary(client, run_id: str) -> dict:
    import mlflow

    path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="summary.json")
    return json.loads(Path(path).read_text())


def resolve_data(repo: str | Path, tags: dict) -> tuple[str, list[tuple[str, int]]]:
    """Find the git rev whose ``<data_path>.dvc`` (tag ``data_path``, default ``data``) names the recorded md5 and
    read every raw-log shard at it through DVC. Aggregated data (DAgger: ``data_path`` ``a+b``, ``dvc_md5``
    ``md5a+md5b``) resolves each folder at the same rev.

    Returns (rev, [(shard path, bytes)]). Raises LineageError when no rev matches or a shard cannot be read.
    """
    from dvc.api import DVCFileSystem

    from evoharness.data.rawlog import dvc_md5, read_episodes

    want = tags.get("dvc_md5")
    if not want:
        raise LineageError("the model version has no dvc_md5 tag: it was not registered by the pipeline")
    paths, wants = (tags.get("data_path") or "data").split("+"), want.split("+")
    if len(paths) != len(wants):
        raise LineageError(f"data_path {tags.get('data_path')!r} names {len(paths)} folders but dvc_md5 {want!r} "
                           f"{len(wants)} versions")
    revs = [tags["data_rev"]] if tags.get("data_rev") not in (None, "", "workspace") else []
    revs += [r for r in (tags.get("git_commit"), "HEAD") if r and r != "unknown"]
    rev = None
    for candidate in dict.fromkeys(revs):
        try:
            if all(dvc_md5(repo, candidate, f"{p}.dvc") == w for p, w in zip(paths, wants)):
                rev = candidate
                break
        except FileNotFoundError:
            continue
    files = " and ".join(f"{p}.dvc" for p in paths)
    if rev is None:
        raise LineageError(f"no git rev among {revs} of {repo} has {files} naming md5 {want}; the data version "
                           f"was never committed here (check out the repository this model was trained from)")
    shards = []
    fs = DVCFileSystem(str(repo), rev=rev)
    for data_path, w in zip(paths, wants):
        try:
            episodes, md5 = read_episodes(repo, rev, f"{data_path}/logs")
        except Exception as exc:
            raise LineageError(f"raw logs md5 {w} at rev {rev} do not resolve through DVC: {exc}. Restore them "
                               f"with `dvc pull` from the remote, or re-run collection with the profile that made "
                               f"them") from exc
        if md5 != w:
            raise LineageError(f"{data_path}.dvc at rev {rev} names md5 {md5}, the model records {w}")
        for path in sorted(fs.find(f"{data_path}/logs")):
            with fs.open(path, "rb") as fh:
                shards.append((path, len(fh.read())))
    return rev, shards


def harness_diff(model: dict, parent: dict) -> list[str]:
    """Lines comparing meta-actions per episode (by type, and by task type) of a model and its parent."""
    lines = [f"{'meta-action':<12}{'model':>8}{'parent':>8}{'change':>8}"]
    for m in META_ACTIONS:
        a, b = model["meta_actions_per_episode"][m], parent["meta_actions_per_episode"][m]
        lines.append(f"{m:<12}{a:>8.2f}{b:>8.2f}{a - b:>+8.2f}")
    lines.append(f"\n{'task type':<10}" + "".join(f"{m:>16}" for m in META_ACTIONS) + "   (model / parent)")
    mt, pt = model.get("meta_actions_by_task_type", {}), parent.get("meta_actions_by_task_type", {})
    for t in sorted(set(mt) | set(pt)):
        cells = "".join(f"{mt.get(t, {}).get(m, 0):>9.2f} /{pt.get(t, {}).get(m, 0):>5.2f}" for m in META_ACTIONS)
        lines.append(f"{t:<10}{cells}")
    return lines


def audit(model_uri: str, repo: str | Path, out=print) -> dict:
    """Print and verify the lineage of ``model_uri``. Returns what was found; raises LineageError on failure."""
    from mlflow import MlflowClient

    from evoharness.registry.promotion import parse_model_uri

    parsed = parse_model_uri(model_uri)
    if parsed is None:
        raise ValueError(f"{model_uri!r} is not a registered model URI (models:/NAME/VERSION or models:/NAME@ALIAS)")
    name, version = parsed
    client = MlflowClient()
    mv = client.get_model_version(name, version)
    tags = mv.tags
    if tags.get("release") and not tags.get("pipeline_run_id"):
        return audit_release(name, version, mv, repo, out)
    required = ("dvc_md5", "data_rev", "trace_hash", "git_commit", "pipeline_run_id", "parent_model_run_id")
    missing = [t for t in required if not tags.get(t)]
    if missing:
        raise LineageError(f"{name} version {version} lacks lineage tags {missing}: it was not registered by the "
                           f"pipeline, or its tags were removed")
    out(f"model      {name} version {version}  aliases {mv.aliases}  run {mv.run_id}")
    out(f"code       git {tags.get('git_commit')} (dirty: {tags.get('git_dirty')}), profile {tags.get('profile')}, "
        f"config digest {tags.get('config_digest')}")
    out(f"prefect    flow run {tags.get('prefect_flow_run_id')}  deployment {tags.get('prefect_deployment_id') or '-'}")
    for label, key in (("pipeline", "pipeline_run_id"), ("grpo", "grpo_run_id"), ("parent/sft", "parent_model_run_id"),
                       ("traces", "trace_run_id")):
        run_id = tags.get(key)
        if run_id:
            r = client.get_run(run_id)
            note = "" if r.info.status in ("FINISHED", "RUNNING") else "   <- WARNING: this run did not finish"
            out(f"run        {label:<11}{run_id}  {r.info.run_name}  {r.info.status}{note}")
    inputs = client.get_run(mv.run_id).inputs.dataset_inputs if mv.run_id else []
    digests = [d.dataset.digest for d in inputs]
    out(f"traces     hash {tags.get('trace_hash')}  (dataset input digests {digests})")
    if tags["trace_hash"][:16] not in digests:
        raise LineageError(f"the register run's dataset inputs {digests} do not include trace hash "
                           f"{tags['trace_hash']}")
    rev, shards = resolve_data(repo, tags)
    out(f"data       rev {tags.get('data_rev')} -> git {rev}, DVC md5 {tags.get('dvc_md5')}: resolves, md5 matches")
    for path, size in shards:
        out(f"raw logs   {path}  {size} bytes")
    for key in sorted(k for k in tags if k.startswith("dagger_policy.")):
        out(f"dagger     {key.split('.', 1)[1]}/ holds episodes {tags[key]} played, labelled by the expert")
    evals = [e for e in tags.get("evaluation_run_ids", "").split(",") if e]
    out(f"evaluated  {evals or 'never'}")
    found = {"name": name, "version": version, "rev": rev, "shards": shards, "evaluations": evals}
    parent_eval = tags.get("parent_evaluation_run_id")
    if evals and parent_eval:
        model_summary, parent_summary = _run_summary(client, evals[0]), _run_summary(client, parent_eval)
        out(f"\nharness use, model vs its parent on the same {model_summary['episodes']} "
            f"{model_summary['split']} games:")
        for line in harness_diff(model_summary, parent_summary):
            out(line)
        found["harness_diff"] = {"model": model_summary["meta_actions_per_episode"],
                                 "parent": parent_summary["meta_actions_per_episode"]}
    return found


def audit_release(name: str, version: str, mv, repo: str | Path, out=print) -> dict:
    """The lineage of a version registered from a release folder (``evoharness.registry.release.register_release``): its
    training ran on another machine, so its runs are not in this store. Prints what the release's card records and
    verifies what this checkout can: the source commit is in its history, and ``<data_path>.dvc`` at that commit
    (or, when the data was committed after the code, at HEAD) names the recorded data md5. Raises LineageError
    when either does not hold."""
    import subprocess

    from evoharness.data.rawlog import dvc_md5

    tags = mv.tags
    out(f"model      {name} version {version}  aliases {mv.aliases}  release {tags['release']} "
        f"({tags.get('release_path')})")
    out("training   its training run is NOT in this store: the release was trained elsewhere and registered "
        "from its folder. What its model card records instead:")
    for key in ("source_commit", "profile", "config_digest", "data_path", "dvc_md5", "trace_hash", "trained_until"):
        out(f"           {key:<15}{tags.get(key)}")
    commit, data_path = tags.get("source_commit") or "", tags.get("data_path") or "data"
    known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=repo, capture_output=True)
    if known.returncode != 0:
        raise LineageError(f"source commit {commit!r} is not in the history of {repo}: fetch the repository the "
                           f"release came from")
    found = {}
    for rev in dict.fromkeys((commit, "HEAD")):  # the data version is committed at or after the code that used it
        try:
            found[rev] = dvc_md5(repo, rev, f"{data_path}.dvc")
        except FileNotFoundError:
            found[rev] = None
    rev = next((r for r, m in found.items() if m == tags.get("dvc_md5")), None)
    if rev is None:
        raise LineageError(f"{data_path}.dvc names md5 {found} at the source commit and HEAD, the release records "
                           f"{tags.get('dvc_md5')}: check out the repository the release came from")
    out(f"code       git {commit} is in this checkout's history")
    out(f"data       {data_path}.dvc at {rev if rev == 'HEAD' else rev[:12]} names md5 {found[rev]}: matches. The logs "
        f"themselves: `make collect ARGS=\"--profile {tags.get('profile')}\"` regenerates them (collection is "
        f"deterministic)")
    evals = [e for e in tags.get("evaluation_run_ids", "").split(",") if e]
    out(f"evaluated  {evals or 'never'} (recorded in the release, not replayed)")
    parent = release_parent(tags.get("release_path"))
    if parent:  # trained further from another release: which one, and how the two compare on the same games
        out(f"parent     release {parent['name']} as of git {parent['git_commit']} ({parent['command']})")
        t = parent.get("paired_test")
        if t:
            out(f"           on the same {t['games']} {t['split']} games: {t['only_a']} won only by this policy, "
                f"{t['only_b']} only by the parent, exact McNemar p = {t['p']:.3g}")
    return {"name": name, "version": version, "release": tags["release"], "rev": commit, "evaluations": evals,
            "parent": parent}


def release_parent(release_path: str | None) -> dict | None:
    """The ``parent`` block of the release folder's ``release.json`` (None when the folder is gone or has none)."""
    from evoharness.registry.release import is_release, read_release

    return read_release(release_path).get("parent") if release_path and is_release(release_path) else None


def main(argv: list[str] | None = None) -> int:
    from evoharness.registry.tracking import configure

    p = argparse.ArgumentParser(description="Print and verify a registered policy's lineage.")
    p.add_argument("model_uri", help="models:/NAME/VERSION or models:/NAME@ALIAS")
    p.add_argument("--repo", default=".", help="the project checkout holding data.dvc and mlflow/ (default: .)")
    a = p.parse_args(argv)
    from mlflow.exceptions import MlflowException

    from evoharness.registry.tracking import USER_TRACKING_URI

    store = Path(a.repo) / "mlflow" / "mlflow.db"
    if not USER_TRACKING_URI and not store.exists():
        print(f"no MLflow store at {store}: pass --repo with the checkout that ran the pipeline", file=sys.stderr)
        return 2
    configure(a.repo)
    try:
        audit(a.model_uri, a.repo)
    except LineageError as exc:
        print(f"lineage check FAILED: {exc}", file=sys.stderr)
        return 1
    except (MlflowException, ValueError) as exc:  # an unknown model, alias or version
        print(f"cannot resolve {a.model_uri}: {exc}", file=sys.stderr)
        return 2
    print("lineage check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
