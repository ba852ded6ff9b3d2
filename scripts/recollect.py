"""Collect a profile's raw logs into a staging folder (not its DVC-tracked path), resumably, at low priority.

For a new data version made with changed collection code (e.g. the expert's move tracking, 2026-12-02): the
committed version stays checked out and named by its ``.dvc`` file while the new one is collected; a killed run
started again plays only the missing games (``evoharness.data.collect``). When it is complete, make it the new version
on purpose: move it to the profile's ``collect.path``, ``dvc add`` that path and commit its ``.dvc`` file.

    nice -n 19 python scripts/recollect.py --profile full --out runs/data-full-v2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoharness.config import load_profile
from evoharness.data.collect import collect, profile_games


def main(argv: list[str] | None = None) -> dict:
    """Collect ``--profile``'s games into ``--out`` (see module docstring); prints progress lines every 25 episodes.

    Returns ``evoharness.data.collect.collect``'s manifest (episodes, won, steps, failed, settings, games) plus
    ``wall_s``, ``resumed`` and ``worker_stats``. Raises FileNotFoundError when the split's games are missing, and what
    ``load_profile`` raises for an unknown profile."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="full")
    p.add_argument("--out", required=True, help="staging folder (its partial folder sits beside it)")
    args = p.parse_args(argv)
    c = load_profile(args.profile).collect
    games = profile_games(c)
    t0 = time.time()

    def progress(done: int, total: int, rate: float, eta_s: float) -> None:
        if done % 25 == 0 or done == total:
            print(f"{time.strftime('%H:%M:%S')} collect {done}/{total} episodes, {rate:.1f} episodes/min, "
                  f"ETA {eta_s / 60:.0f} min", flush=True)

    m = collect(games, args.out, c, progress=progress)
    print(f"{m['episodes']} episodes, {m['won']} won, {m['steps']} steps, {len(m['failed'])} failed, "
          f"{m['resumed']} resumed, {time.time() - t0:.0f} s")
    return m


if __name__ == "__main__":
    main()
