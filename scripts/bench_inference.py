"""Policy inference against the environment-only floor, measured in one run on one machine (issue 36).

    python scripts/bench_inference.py --policy models/evoharness-full-sft --limit 24 --batch 8 \
        --out docs/benchmarks/inference

Plays the same ``valid_seen`` games three ways, with the release's play settings (50 steps, score decoding, ...):

* (a) **floor**: the episodes of (b) replayed from their recorded commands, no policy, through as many
  environment processes as (c) uses (``--batch`` x ``--batched-workers`` at once): what the simulator alone costs;
* (b) **batch-1**: today's path, one episode at a time per process, ``--workers`` processes
  (``evaluate.batch_episodes`` 1);
* (c) **batched**: ``--batched-workers`` processes (default 1), each playing ``--batch`` episodes at once, their
  model calls batched (``evaluate.batch_episodes``, ``evoharness.policy.batched_play``).

Prints episodes/min, environment steps/s, policy turns/s and generated tokens/s of each, the ratios (b)/(a) and
(c)/(a) of wall time, and how many games (b) and (c) played identically (same calls and commands) and with the same
outcome; writes ``OUT.json`` and ``OUT.md``. ``--memory N`` also plays N episodes of the expert through one
environment process recycled as evaluation recycles it, and through one that is never recycled, printing the
child's resident memory every 50 episodes (the reset leak and its bound).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python scripts/bench_inference.py`


def _calls(result) -> list[tuple]:
    return [(e["turn"], e.get("command"), json.dumps(e.get("args"), sort_keys=True)) for e in result.transcript]


def _rates(results, wall_s: float) -> dict:
    turns = sum(len(r.transcript) for r in results)
    steps = sum(r.env_steps for r in results)
    tokens = sum(r.generated_tokens for r in results)
    return {"episodes": len(results), "wall_s": round(wall_s, 1), "won": sum(r.won for r in results),
            "episodes_per_min": round(len(results) / wall_s * 60, 2), "env_steps": steps,
            "env_steps_per_s": round(steps / wall_s, 2), "turns_per_s": round(turns / wall_s, 2),
            "tokens_per_s": round(tokens / wall_s, 1)}


def replay_floor(results, data_dir: str | None, lanes: int, max_steps: int) -> dict:
    """(a): each episode's executed commands replayed in ``EnvWorker`` processes, ``lanes`` episodes at once."""
    from evoharness.env.pool import EnvWorker, RemoteEnv

    jobs = [(r.game, [e["command"] for e in r.transcript if e["turn"] == "act"]) for r in results]
    it, lock = iter(jobs), threading.Lock()
    workers = [EnvWorker(50) for _ in range(lanes)]
    for w in workers:  # started before the clock, as (c)'s are by its first game
        w.call("close")
    steps = [0]

    def lane(k: int) -> None:
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            env = RemoteEnv(workers[k], job[0], max_steps + 1, False, data_dir)
            env.reset(0)
            for command in job[1]:
                env.step(command)
            with lock:
                steps[0] += len(job[1])
            env.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=lane, args=(k,)) for k in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for w in workers:
        w.stop()
    return {"episodes": len(jobs), "wall_s": round(wall, 1), "episodes_per_min": round(len(jobs) / wall * 60, 2),
            "env_steps": steps[0], "env_steps_per_s": round(steps[0] / wall, 2)}


def rollout_rates(policy: str, profile: str, episodes: int, batch: int, work: Path, max_env_steps: int = 0) -> dict:
    """GRPO rollouts at ``profile``'s ``grpo`` settings (sampled, the release's layout and cost): ``episodes``
    episodes of train games from ``grpo.game_offset``, one at a time (TurnRollouts.play) and ``batch`` at once
    (``run_lanes``, as ``grpo.batch_episodes`` plays them). Returns both rates and their ratio."""
    import torch

    from evoharness.config import TraceConfig, load_profile
    from evoharness.env.alfworld import list_games
    from evoharness.harness.context import with_layout
    from evoharness.policy.batched_play import run_lanes
    from evoharness.registry.release import experience_path
    from evoharness.training.model import load_policy
    from evoharness.training.rollouts import TurnRollouts

    cfg = load_profile(profile, {"grpo": {"max_env_steps": max_env_steps}} if max_env_steps else None)
    model, tok = load_policy(policy)
    model.eval()
    wcfg = with_layout(TraceConfig(context="turn"), model.config)
    games = list_games(cfg.grpo.split, limit=episodes, offset=cfg.grpo.game_offset)
    out = {}
    for name, lanes in (("batch-1", 1), ("batched", batch)):
        exp = work / f"rollouts-{name}.db"
        shutil.copy(experience_path(policy), exp)
        ro = TurnRollouts({}, cfg.grpo, cfg.cost, str(exp), str(work / f"history-{name}.jsonl"), None, wcfg)
        t0 = time.perf_counter()
        with torch.no_grad():
            if lanes == 1:
                played = [ro.play(model, tok, g, f"bench-{i}", i) for i, g in enumerate(games)]
            else:
                played = run_lanes(model, tok, list(enumerate(games)), lanes, 50,
                                   lambda job, lane: ro.play(model, tok, job[1], f"bench-{job[0]}", job[0], lane=lane))
        wall = time.perf_counter() - t0
        results = [r for r, _ in played]
        out[name] = _rates(results, wall) | {"rollouts_per_min": round(len(results) / wall * 60, 2),
                                             "sampled_turns": sum(len(t) for _, t in played)}
        print(f"  rollouts {name}: {out[name]}", flush=True)
    out["speedup"] = round(out["batch-1"]["wall_s"] / out["batched"]["wall_s"], 2)
    return out


def memory_curve(episodes: int, recycle_every: int, data_dir: str | None) -> list[tuple[int, float]]:
    """Resident MB of one environment process after every 50 of ``episodes`` expert episodes on ``train`` games."""
    from evoharness.env.alfworld import list_games
    from evoharness.env.pool import EnvWorker, RemoteEnv

    games = list_games("train")
    worker, curve = EnvWorker(recycle_every), []
    for n in range(1, episodes + 1):
        env = RemoteEnv(worker, games[(n * 7) % len(games)], 51, True, data_dir)
        res = env.reset(0)
        for _ in range(50):
            if res.done:
                break
            res = env.step(res.expert_action or "look")
        rss = worker.rss_mb()  # before close: the process as the episode left it
        env.close()
        if n % 50 == 0:
            curve.append((n, round(rss, 1)))
            print(f"  memory recycle_every={recycle_every}: {n} episodes, env process {rss:.0f} MB", flush=True)
    worker.stop()
    return curve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="models/evoharness-full-sft", help="a release folder")
    p.add_argument("--split", default="valid_seen")
    p.add_argument("--limit", type=int, default=24, help="games, evenly spaced over the split (0: all)")
    p.add_argument("--batch", type=int, default=8, help="(c): episodes at once")
    p.add_argument("--workers", type=int, default=2, help="(b): processes of one episode at a time")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of (c)'s process (1: the other core steps the environments)")
    p.add_argument("--batched-workers", type=int, default=1,
                   help="(c): processes, each playing --batch episodes at once (their cores split between them)")
    p.add_argument("--memory", type=int, default=0, help="also the memory curve over this many episodes")
    p.add_argument("--rollouts", type=int, default=0,
                   help="also GRPO rollouts: this many sampled train episodes at --rollout-profile's grpo settings")
    p.add_argument("--rollout-profile", default="full")
    p.add_argument("--max-env-steps", type=int, default=0,
                   help="a shorter step budget for a quick run (0: the release's and the profile's)")
    p.add_argument("--work-dir", default="runs/bench-inference")
    p.add_argument("--out", default="", help="write OUT.json and OUT.md")
    a = p.parse_args(argv)

    import torch

    from evoharness.env.alfworld import list_games
    from evoharness.evaluation.evaluate import evaluate, spread
    from evoharness.policy.agent import EpisodeResult
    from evoharness.registry.release import experience_path, play_settings

    cfg, cost = play_settings(a.policy, {"max_env_steps": a.max_env_steps or None})
    games = spread(list_games(a.split), a.limit)
    work = Path(a.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(a.threads)  # (b)'s workers set their own: cores / workers each
    print(f"{len(games)} {a.split} games, policy {a.policy}, {cores} cores; (b) {a.workers} process(es), "
          f"(c) {a.batched_workers} process(es) of {a.batch} episodes at once", flush=True)
    runs = {}
    for name, over in (("batch-1", {"batch_episodes": 1, "workers": a.workers}),
                       ("batched", {"batch_episodes": a.batch, "workers": a.batched_workers})):
        t0 = time.perf_counter()
        evaluate(a.policy, games, dataclasses.replace(cfg, **over), cost, work / name, experience_path(a.policy),
                 progress=None)
        rows = (work / name / "transcripts.jsonl").read_text().splitlines()
        results = [EpisodeResult(**json.loads(x)) for x in rows]
        runs[name] = (results, time.perf_counter() - t0)
        print(f"  {name}: {_rates(results, runs[name][1])}", flush=True)
    floor = replay_floor(runs["batch-1"][0], None, a.batch * a.batched_workers, cfg.max_env_steps)
    print(f"  floor: {floor}", flush=True)
    b1, bn = runs["batch-1"][0], runs["batched"][0]
    same_calls = sum(_calls(x) == _calls(y) for x, y in zip(b1, bn))
    same_outcome = sum(x.won == y.won for x, y in zip(b1, bn))
    report = {
        "policy": a.policy, "split": a.split, "games": len(games), "cores": cores, "batch": a.batch,
        "workers": a.workers, "batched_workers": a.batched_workers, "machine": _machine(),
        "floor": floor, "batch_1": _rates(*runs["batch-1"]), "batched": _rates(*runs["batched"]),
        "identical_episodes": same_calls, "same_outcome": same_outcome,
        "differing_games": [x.game for x, y in zip(b1, bn) if x.won != y.won],
    }
    report["ratio_batch_1_to_floor"] = round(report["batch_1"]["wall_s"] / floor["wall_s"], 2)
    report["ratio_batched_to_floor"] = round(report["batched"]["wall_s"] / floor["wall_s"], 2)
    report["speedup_batched_over_batch_1"] = round(report["batch_1"]["wall_s"] / report["batched"]["wall_s"], 2)
    if a.rollouts:
        report["rollouts"] = rollout_rates(a.policy, a.rollout_profile, a.rollouts, a.batch, work, a.max_env_steps)
    if a.memory:
        report["memory_mb_recycled"] = memory_curve(a.memory, cfg.env_recycle_every, None)
        report["memory_mb_never_recycled"] = memory_curve(a.memory, 0, None)
    md = markdown(report)
    print(md)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
        Path(a.out + ".md").write_text(md + "\n")
    return 0


def _machine() -> str:
    from evoharness.registry.release import machine_description

    return machine_description()


def markdown(r: dict) -> str:
    """The report as a Markdown table (one row per path) and its ratios."""
    rows = [("(a) environment only (replayed commands)", r["floor"]), ("(b) batch-1 policy", r["batch_1"]),
            ("(c) batched policy", r["batched"])]
    lines = [f"{r['games']} `{r['split']}` games, `{r['policy']}`, {r['machine']}; (b) {r['workers']} processes, "
             f"(c) {r['batched_workers']} process(es) of {r['batch']} episodes at once.", "",
             "| path | wall s | episodes/min | env steps/s | turns/s | generated tokens/s | won |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, x in rows:
        lines.append(f"| {name} | {x['wall_s']} | {x['episodes_per_min']} | {x['env_steps_per_s']} | "
                     f"{x.get('turns_per_s', '-')} | {x.get('tokens_per_s', '-')} | {x.get('won', '-')} |")
    lines += ["", f"(b)/(a) {r['ratio_batch_1_to_floor']}x, (c)/(a) {r['ratio_batched_to_floor']}x of the floor's "
              f"wall time; (c) is {r['speedup_batched_over_batch_1']}x faster than (b). Identical episodes (same "
              f"calls and commands) {r['identical_episodes']} of {r['games']}; same outcome {r['same_outcome']} of "
              f"{r['games']}."]
    if "rollouts" in r:
        ro = r["rollouts"]
        lines += ["", "GRPO rollouts (sampled, train games):", "",
                  "| path | wall s | rollouts/min | env steps/s | turns/s | generated tokens/s |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name in ("batch-1", "batched"):
            x = ro[name]
            lines.append(f"| {name} | {x['wall_s']} | {x['rollouts_per_min']} | {x['env_steps_per_s']} | "
                         f"{x['turns_per_s']} | {x['tokens_per_s']} |")
        lines += ["", f"Batched rollouts: {ro['speedup']}x the rollouts per minute of batch-1."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
