"""Collection alone: make ``<collect.path>/`` hold the raw logs of a profile (check out, pull from the default DVC
remote, regenerate what its ``.dvc`` file names, or collect and ``dvc add``), then ``dvc push``.

    python -m flows.collect [--profile NAME]        # e.g. --profile full: all 3,553 train games into data-full/
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prefect import flow

from evoharness.config import load_profile
from tasks.data import collect_task
from tasks.run import pipeline_run

REPO = str(Path(__file__).resolve().parent.parent)


@flow(name="evoharness-collect")
def collect_flow(profile: str = "default", repo: str = REPO) -> dict:
    """Run the collect stage under its own MLflow run; returns ``{"status", "md5", "pushed"}``."""
    cfg = load_profile(profile)
    with pipeline_run("collect", cfg, repo, None) as run:
        return collect_task(cfg, repo, run.info.run_id)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Collect (or regenerate) the DVC-tracked raw logs.")
    p.add_argument("--profile", default="default")
    out = collect_flow(profile=p.parse_args(argv).profile)
    print(out)
    return out


if __name__ == "__main__":
    main()
