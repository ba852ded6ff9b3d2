"""DAgger collection: a trained policy plays train games, ALFWorld's handcoded expert labels every state it reaches.

    python -m flows.dagger --policy models:/NAME/VERSION --tag TAG [--profile NAME] [--num-games N]
                           [--game-offset K] [--workers W]

The expert-labelled episodes go to the DVC-tracked folder ``data-dagger-<TAG>/`` (``data-dagger-<TAG>.dvc``, pushed
to the default remote). A profile aggregates them with its expert logs through ``ingest.dagger`` (see
``profiles/full-dagger.yaml``), so the traces, and the model's lineage, name both data versions. Rollout budgets
and decoding are the profile's ``evaluate`` settings (greedy).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prefect import flow

from evoharness.config import load_profile
from tasks.data import dagger_task
from tasks.run import pipeline_run

REPO = str(Path(__file__).resolve().parent.parent)


@flow(name="evoharness-dagger")
def dagger_flow(policy: str, tag: str, profile: str = "full", num_games: int = 200, game_offset: int = 0,
                workers: int = 2, repo: str = REPO) -> dict:
    """Run the DAgger collection under its own MLflow run; returns the task's summary (status, path, md5, episodes,
    labelled steps, agreement)."""
    if policy in ("expert", "random"):
        raise ValueError(f"--policy {policy}: DAgger labels a trained policy's states; give a model")
    cfg = load_profile(profile)
    with pipeline_run("dagger", cfg, repo, None) as run:
        return dagger_task(policy, cfg, repo, tag, num_games, game_offset, workers, run.info.run_id)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Collect expert-labelled episodes of a trained policy (DAgger).")
    p.add_argument("--policy", required=True, help="a model folder or a pinned MLflow version, models:/NAME/VERSION")
    p.add_argument("--tag", required=True, help="names the folder data-dagger-<TAG>/ and its episodes")
    p.add_argument("--profile", default="full", help="rollout budgets, decoding and costs (default: full)")
    p.add_argument("--num-games", type=int, default=200, help="train games, evenly spaced (default: 200)")
    p.add_argument("--game-offset", type=int, default=0, help="skip the first K sorted train games")
    p.add_argument("--workers", type=int, default=2, help="processes, each with its own copy of the policy")
    a = p.parse_args(argv)
    out = dagger_flow(a.policy, a.tag, a.profile, a.num_games, a.game_offset, a.workers)
    print(out)
    return out


if __name__ == "__main__":
    main()
