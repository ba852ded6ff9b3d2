"""Benchmarks that print figures (not timed tests): collection episodes/min with 1 worker and with every core,
peak memory per worker, and trace construction episodes/s. ``--textworld-speedups both`` also collects the games
with TextWorld as shipped (``EVOHARNESS_TEXTWORLD_SPEEDUPS=0``, read by the spawned workers) and says whether the
logs are byte-identical.

    python scripts/benchmark.py [--games 12] [--split train] [--stride 97] [--textworld-speedups on|off|both]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoharness.config import CollectConfig, TraceConfig  # noqa: E402
from evoharness.data.collect import collect  # noqa: E402
from evoharness.data.rawlog import parse_lines  # noqa: E402
from evoharness.env import textworld_speedups  # noqa: E402
from evoharness.env.alfworld import list_games  # noqa: E402
from evoharness.harness.traces import build_traces  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--games", type=int, default=12)
    p.add_argument("--split", default="train")
    p.add_argument("--stride", type=int, default=97)
    p.add_argument("--textworld-speedups", choices=("on", "off", "both"), default="on")
    a = p.parse_args(argv)
    games = list_games(a.split, limit=a.games, stride=a.stride)
    print(f"{len(games)} {a.split} games (every {a.stride}th), {mp.cpu_count()} cores")
    logs = None
    modes = {"on": ["1"], "off": ["0"], "both": ["0", "1"]}[a.textworld_speedups]
    shards = {}
    for speedups, workers in [(m, w) for m in modes for w in sorted({1, mp.cpu_count()})]:
        os.environ[textworld_speedups.ENV_VAR] = speedups
        print(f"TextWorld speed-ups {'on' if speedups == '1' else 'off (as shipped)'}:")
        cfg = dataclasses.replace(CollectConfig(), workers=workers)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            manifest = collect(games, Path(tmp) / "data", cfg)
            wall = time.time() - t0
            shards[speedups, workers] = (Path(tmp) / "data" / "logs" / "shard-00000.jsonl").read_text()
            logs = shards[speedups, workers].splitlines()
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        print(f"collect  workers={workers}: {manifest['episodes']} episodes, {manifest['steps']} steps in {wall:.1f} s "
              f"= {manifest['episodes'] / wall * 60:.1f} episodes/min; peak RSS of a worker so far {peak_mb:.0f} MB")
        stats = manifest["worker_stats"]
        print(f"         worker memory after each episode: {min(w['rss_mb'] for w in stats):.0f}-"
              f"{max(w['rss_mb'] for w in stats):.0f} MB, peak {max(w['peak_rss_mb'] for w in stats):.0f} MB")
    if len(set(shards.values())) > 1:
        print("logs DIFFER between settings:", sorted(shards))
    elif len(shards) > 1:
        runs = ", ".join(f"speedups={m} workers={w}" for m, w in shards)
        print(f"logs byte-identical across {len(shards)} runs ({runs})")
    episodes = parse_lines(logs, "benchmark")
    for context in ("history", "turn"):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            stats = build_traces(episodes, TraceConfig(context=context), tmp)
            wall = time.time() - t0
        print(f"traces   {context:<8}{stats['episodes']} episodes in {wall:.2f} s = {stats['episodes'] / wall:.1f} "
              f"episodes/s ({stats['kept']} kept, {stats['train_rows']} train rows, "
              f"{stats['workspace_tokens_mean']:.0f} rendered workspace tokens on average)")


if __name__ == "__main__":
    main()
