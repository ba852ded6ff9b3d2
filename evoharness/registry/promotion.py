"""MLflow model-registry steps: evaluation links and the ``champion`` promotion rule.

Each registered version carries its evaluations as tags: ``eval.<split>.<games sha>.success_rate`` and
``eval.<split>.<games sha>.run_id`` (``games sha`` fingerprints the exact game list), plus ``evaluation_run_ids``.
The ``champion`` alias moves to a candidate only when the candidate's success rate on the same split and games is
at least the champion's and at least a floor (``promote.min_success``), so a policy that cannot play never becomes
champion (MLflow registry aliases: https://mlflow.org/docs/latest/model-registry).
"""

from __future__ import annotations

import hashlib
import json


def games_sha(games: list[str]) -> str:
    """12 hex chars fingerprinting an exact, ordered list of games."""
    return hashlib.sha256(json.dumps(games).encode()).hexdigest()[:12]


def parse_model_uri(uri: str) -> tuple[str, str] | None:
    """``models:/NAME/VERSION`` or ``models:/NAME@ALIAS`` -> (name, version); None for other URIs."""
    from mlflow import MlflowClient

    if not uri.startswith("models:/"):
        return None
    rest = uri[len("models:/"):]
    if "@" in rest:
        name, alias = rest.split("@", 1)
        return name, str(MlflowClient().get_model_version_by_alias(name, alias).version)
    if "/" in rest:
        name, version = rest.rsplit("/", 1)
        return name, version
    return None


def link_evaluation(model_uri: str, split: str, games: list[str], success_rate: float, run_id: str) -> None:
    """Record an evaluation run on the registered version ``model_uri`` (no-op for unregistered policies)."""
    from mlflow import MlflowClient

    parsed = parse_model_uri(model_uri)
    if parsed is None:
        return
    name, version = parsed
    client = MlflowClient()
    key = f"eval.{split}.{games_sha(games)}"
    client.set_model_version_tag(name, version, f"{key}.success_rate", f"{success_rate:.6f}")
    client.set_model_version_tag(name, version, f"{key}.run_id", run_id)
    mv = client.get_model_version(name, version)
    runs = [r for r in mv.tags.get("evaluation_run_ids", "").split(",") if r] + [run_id]
    client.set_model_version_tag(name, version, "evaluation_run_ids", ",".join(dict.fromkeys(runs)))


def link_parent_evaluation(model_uri: str, run_id: str) -> None:
    """Tag the registered version ``model_uri`` with the evaluation run of its parent policy."""
    from mlflow import MlflowClient

    name, version = parse_model_uri(model_uri)
    MlflowClient().set_model_version_tag(name, version, "parent_evaluation_run_id", run_id)


def recorded_evaluation_tag(name: str, version: str, split: str, games: list[str], field: str) -> str | None:
    """A tag ``link_evaluation`` recorded on a version for exactly this split and game list (``field``:
    ``success_rate`` or ``run_id``), if any."""
    from mlflow import MlflowClient

    return MlflowClient().get_model_version(name, version).tags.get(f"eval.{split}.{games_sha(games)}.{field}")


def recorded_success(name: str, version: str, split: str, games: list[str]) -> float | None:
    """The success rate recorded on a version for exactly this split and game list, if any."""
    tag = recorded_evaluation_tag(name, version, split, games, "success_rate")
    return float(tag) if tag is not None else None


def promote(name: str, candidate: str, split: str, games: list[str], evaluate_version,
            min_success: float = 0.0) -> dict:
    """Move alias ``champion`` to version ``candidate`` if its success rate on (split, games) is at least
    ``min_success`` and at least the champion's; the champion is evaluated on those games first when it has no such
    record (``evaluate_version(version) -> success_rate``). Returns the comparison, with ``promoted`` and ``reason``.
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient()
    cand = recorded_success(name, candidate, split, games)
    if cand is None:
        raise ValueError(f"version {candidate} of {name} has no evaluation on {split} games {games_sha(games)}")
    try:
        champion = str(client.get_model_version_by_alias(name, "champion").version)
    except MlflowException:
        champion = None
    champ = None
    if champion is not None and champion != candidate:
        champ = recorded_success(name, champion, split, games)
        if champ is None:
            champ = evaluate_version(champion)
    if cand < min_success:
        promoted, reason = False, f"below the floor promote.min_success {min_success:.3f}"
    elif champion is None or champion == candidate:
        promoted, reason = True, "no champion yet" if champion is None else "already champion"
    else:
        promoted = cand >= champ
        reason = "not worse than the champion" if promoted else "worse than the champion"
    if promoted:
        client.set_registered_model_alias(name, "champion", candidate)
    return {"candidate_version": candidate, "candidate_success_rate": cand, "champion_version": champion,
            "champion_success_rate": champ, "split": split, "games_sha": games_sha(games), "promoted": promoted,
            "min_success": min_success, "reason": reason}


def alias_version(name: str, alias: str) -> str | None:
    """The version ``alias`` points at in registered model ``name``, or None (no such model or alias)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return str(MlflowClient().get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def experience_of(model_uri: str, dst: str) -> str | None:
    """Download the Experience store a registered version plays with (its tag ``experience_artifact``, an artifact
    of the run that logged it) into ``dst``; None when the version records none."""
    import mlflow
    from mlflow import MlflowClient

    parsed = parse_model_uri(model_uri)
    if parsed is None:
        return None
    mv = MlflowClient().get_model_version(*parsed)
    artifact = mv.tags.get("experience_artifact")
    if not artifact or not mv.run_id:
        return None
    return mlflow.artifacts.download_artifacts(run_id=mv.run_id, artifact_path=artifact, dst_path=dst)
