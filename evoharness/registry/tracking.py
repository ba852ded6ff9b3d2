"""MLflow helpers: the embedded store, lineage tags, stage runs, model logging and registration.

Default store: ``sqlite:///<repo>/mlflow/mlflow.db`` with artifacts under ``<repo>/mlflow/artifacts``, unless
``MLFLOW_TRACKING_URI`` was set when this module was first imported.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

EXPERIMENT = "evoharness"
PIP_REQUIREMENTS = ["torch==2.13.0", "transformers==5.24.0"]
# Read once: ``mlflow.set_tracking_uri`` writes MLFLOW_TRACKING_URI into os.environ (so that subprocesses inherit
# it), so a later read would return the previous repository's store instead of the user's choice.
USER_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI") or None


def configure(repo: str | Path, experiment: str = EXPERIMENT) -> str:
    """Point MLflow at the embedded store of ``repo`` and select ``experiment``.

    A ``MLFLOW_TRACKING_URI`` set before this module was imported wins over the embedded store; one that MLflow
    itself wrote while an earlier ``configure`` pointed at another repository does not.

    Returns the tracking URI.
    """
    import mlflow

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "true")
    root = Path(repo).resolve() / "mlflow"
    uri = USER_TRACKING_URI or f"sqlite:///{root / 'mlflow.db'}"
    root.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        mlflow.create_experiment(experiment, artifact_location=(root / "artifacts").as_uri())
    mlflow.set_experiment(experiment)
    return uri


def git_info(repo: str | Path) -> dict:
    """``{"git_commit", "git_dirty"}`` of ``repo`` (``unknown`` outside git)."""
    def git(*args):
        p = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None

    commit = git("rev-parse", "HEAD") or "unknown"
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": str(bool(status)).lower() if status is not None else "unknown"}


def start_run(name: str, parent_run_id: str | None = None, tags: dict | None = None):
    """Start an MLflow run (nested under ``parent_run_id`` when given) and return it (use as a context manager).

    The run records the process that runs it (``process.pid``, ``process.host``, ``process.start_time``). Then the
    runs of the same name in its experiment left RUNNING by a process that is gone are closed as KILLED with a
    ``killed_reason`` (``evoharness.faults.close_dead_runs``; runs of other hosts are left alone with a warning).

    Raises what ``mlflow.start_run`` raises; when closing the dead runs fails, the new run ends FAILED and the error
    is raised.
    """
    import mlflow

    from evoharness.faults import close_dead_runs, process_tags

    run = mlflow.start_run(run_name=name, nested=parent_run_id is not None, parent_run_id=parent_run_id,
                           tags={**(tags or {}), **process_tags()})
    try:
        close_dead_runs(name, run.info.experiment_id, closer=run.info.run_id)
    except BaseException:
        mlflow.end_run("FAILED")  # not left RUNNING itself by the failure
        raise
    return run


def flat(prefix: str, d: dict) -> dict:
    """Flatten nested dicts into ``prefix.key.sub`` keys (numbers only), for ``mlflow.log_metrics``."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flat(key, v))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key.replace(" ", "_")] = float(v)
    return out


def log_trace_dataset(path: str, content_hash: str, context: str = "training") -> None:
    """Log the trace dataset as an MLflow dataset input of the active run, its content hash as the digest."""
    import mlflow
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource

    dataset = MetaDataset(source=LocalArtifactDatasetSource(str(path)), name="bpe-traces", digest=content_hash[:16])
    mlflow.log_input(dataset, context=context, tags={"trace_hash": content_hash})


def _hub_card_notice(record) -> bool:
    """False for mlflow.transformers' notices that a local policy has no Hugging Face Hub card or license there:
    our policies are never on the hub (their card is the release's ``README.md``), so nothing can be done."""
    message = record.getMessage()
    return not ("could not be retrieved from the hub" in message or "Unable to find license information" in message)


def log_and_register(model_path: str, registered_name: str, alias: str, tags: dict) -> dict:
    """Log the policy in ``model_path`` with ``mlflow.transformers.log_model`` to the active run, register it under
    ``registered_name``, tag the version with ``tags`` and point ``alias`` at it.

    Returns ``{"model_uri", "version", "logged_model_uri"}``; ``model_uri`` is ``models:/NAME/VERSION``.
    """
    import mlflow
    from mlflow import MlflowClient

    from evoharness.training.model import load_policy

    model, tokenizer = load_policy(model_path)
    logger = logging.getLogger("mlflow.transformers")
    if _hub_card_notice not in logger.filters:
        logger.addFilter(_hub_card_notice)
    info = mlflow.transformers.log_model(
        transformers_model={"model": model, "tokenizer": tokenizer}, name="policy", task="text-generation",
        pip_requirements=PIP_REQUIREMENTS, registered_model_name=registered_name)
    client = MlflowClient()
    version = str(info.registered_model_version)
    for k, v in tags.items():
        client.set_model_version_tag(registered_name, version, k, str(v))
    client.set_registered_model_alias(registered_name, alias, version)
    return {"model_uri": f"models:/{registered_name}/{version}", "version": version,
            "logged_model_uri": info.model_uri}
