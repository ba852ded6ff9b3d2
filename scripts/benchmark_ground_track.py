"""Benchmark that prints figures (not a timed test): the decoding cost of ``evaluate.ground_track``.

Both policies (the same model, tracks grounded and free) decide on the same states, one right after the other, so
load on the machine falls on both alike: the free policy's decision is played, the grounded one is only timed.

    python scripts/benchmark_ground_track.py --policy MODEL_PATH|models:/NAME/N [--profile full-parallel-3500]
                                             [--games 4] [--split valid_seen] [--experience FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoharness.config import load_profile  # noqa: E402
from evoharness.env.alfworld import ALFWorldEnv, list_games  # noqa: E402
from evoharness.evaluation.evaluate import make_policy, spread  # noqa: E402
from evoharness.harness.context import turn_view  # noqa: E402
from evoharness.harness.workspace import ExperienceStore, Workspace  # noqa: E402
from evoharness.policy.agent import Decision, run_episode  # noqa: E402
from evoharness.registry.tracking import configure  # noqa: E402


class Paired:
    """Hands every state to ``timed`` (timed only) and then to ``played`` (timed, and its decision played)."""

    def __init__(self, played, timed):
        self.played, self.timed = played, timed
        self.seconds = {"free": 0.0, "grounded": 0.0}
        self.tokens = {"free": 0, "grounded": 0}
        self.decisions = 0

    @property
    def generated_tokens(self) -> int:
        return self.played.generated_tokens

    @property
    def truncated(self) -> bool:
        return self.played.truncated

    def start(self, messages, tools) -> None:
        self.played.start(messages, tools)
        self.timed.start(messages, tools)

    def observe(self, text: str) -> None:
        self.played.observe(text)
        self.timed.observe(text)

    def decide(self, state: dict) -> Decision:
        for name, pol in (("grounded", self.timed), ("free", self.played)):
            before, t0 = pol.generated_tokens, time.perf_counter()
            dec = pol.decide(state)
            self.seconds[name] += time.perf_counter() - t0
            self.tokens[name] += pol.generated_tokens - before
        self.decisions += 1
        return dec  # the free policy's


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policy", required=True)
    p.add_argument("--profile", default="full-parallel-3500")
    p.add_argument("--games", type=int, default=4)
    p.add_argument("--split", default="valid_seen")
    p.add_argument("--experience", default=None, help="an Experience store to start from (copied)")
    a = p.parse_args(argv)
    cfg = load_profile(a.profile)
    configure(Path(__file__).resolve().parent.parent)  # a models:/ URI reads the embedded MLflow store
    with tempfile.TemporaryDirectory() as tmp:
        free, grounded = (make_policy(a.policy, dataclasses.replace(cfg.evaluate, ground_track=on), Path(tmp) / "m",
                                      cfg.traces) for on in (False, True))
        store = (ExperienceStore(a.experience).copy_to(Path(tmp) / "exp.db") if a.experience
                 else ExperienceStore(Path(tmp) / "exp.db"))
        pair = Paired(free, grounded)
        games = spread(list_games(a.split), a.games)
        t0 = time.time()
        for i, game in enumerate(games):
            env = ALFWorldEnv(game, max_steps=cfg.evaluate.max_env_steps + 1, expert=False)
            ws = Workspace.from_config(store, f"bench-{i}", free.layout)
            res = run_episode(env, pair, ws, cfg.cost, cfg.evaluate.max_env_steps, cfg.evaluate.max_meta_actions,
                              seed=cfg.evaluate.seed + i, view=turn_view(free.layout))
            env.close()
            print(f"game {i + 1}/{len(games)}: {res.env_steps} steps, won={res.won}, {pair.decisions} decisions so "
                  f"far, {time.time() - t0:.0f} s")
    n = max(pair.decisions, 1)
    for name in ("free", "grounded"):
        print(f"{name:>8}: {pair.seconds[name] / n * 1000:.0f} ms per decision, "
              f"{pair.tokens[name] / n:.1f} tokens per decision")
    print(f"names scored by the grounded policy: {grounded.grounded} ({grounded.grounded / n:.2f} per decision); "
          f"time ratio grounded/free {pair.seconds['grounded'] / max(pair.seconds['free'], 1e-9):.2f} over "
          f"{pair.decisions} decisions on {len(games)} {a.split} games")


if __name__ == "__main__":
    main()
