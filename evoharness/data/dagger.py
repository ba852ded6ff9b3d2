"""DAgger data: the policy plays, ALFWorld's handcoded expert labels every state the policy reaches.

Dataset Aggregation (Ross, Gordon & Bagnell 2011, "A Reduction of Imitation Learning and Structured Prediction to
No-Regret Online Learning"), the way ALFWorld trained its text agents (Shridhar et al. 2021, "ALFWorld", sec. 4):
behaviour cloning sees only the states the expert visits, so a policy that strays (searches the wrong receptacle,
loops) meets states it never saw a label for. Here the trained policy plays training games with its harness, the
environment runs with the expert beside it, and each executed command is logged with ``expert_action``, the
command the expert would have taken in that state. The logs use the raw-log schema (``evoharness.data.rawlog``) with
``action_source`` ``policy``, so trace construction (``evoharness.harness.traces``) turns them into SFT examples whose
targets are the expert's commands while the prompts show the policy's own history.

Output layout, beside the expert logs it is aggregated with::

    <out_dir>/logs/dagger-<tag>-00000.jsonl   the policy's episodes, expert-labelled
    <out_dir>/dagger-<tag>.json               the policy, games, settings and totals

A killed collection resumes: finished episodes wait in ``<out_dir>/dagger-<tag>.partial/`` (one file per game).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from pathlib import Path

from evoharness.config import CostConfig, EvalConfig, TraceConfig
from evoharness.data.collect import expert_pool
from evoharness.env.alfworld import EXPERT, ALFWorldEnv, task_type_of
from evoharness.evaluation.evaluate import environment_failed


class LabellingEnv:
    """An ``ALFWorldEnv`` with the expert on, logging raw-log records of what the policy does.

    ``records[0]`` is the reset; each ``step(command)`` appends ``{..., "action": command, "action_source":
    "policy", "expert_action": <the expert's command in the state the command was taken in>}``; ``expert_action``
    is null when the expert gave none.
    """

    def __init__(self, env: ALFWorldEnv, episode_id: str):
        self.env, self.episode_id = env, episode_id
        self.game, self.task_type = env.game, task_type_of(env.game)
        self.records: list[dict] = []
        self._expert: str | None = None

    def _record(self, res, **fields) -> None:
        self.records.append({"game": self.game, "task_type": self.task_type, "episode_id": self.episode_id,
                             "step": len(self.records), "observation": res.observation,
                             "admissible_commands": res.admissible_commands, "reward": float(res.reward),
                             "done": bool(res.done), "won": bool(res.won), "perturbed": False, **fields})
        self._expert = res.expert_action

    def reset(self, seed: int = 0):
        res = self.env.reset(seed=seed)
        self.records = []
        self._record(res, action=None, action_source=None)
        return res

    def step(self, command: str):
        expert = self._expert
        res = self.env.step(command)
        self._record(res, action=command, action_source="policy", expert_action=expert)
        return res

    def close(self) -> None:
        self.env.close()


def finish_records(records: list[dict], error: str | None) -> list[dict]:
    """End an episode's records the way the raw-log schema wants: the last record ``done`` (an episode the step
    budget ended is done, unwon) and, when the environment failed, ``error``."""
    if not records:
        return records
    records[-1]["done"] = True
    if environment_failed(error):
        records[-1]["error"] = error
    return records


_POLICY = None  # the worker's policy, loaded once per process


def _init_worker(policy: str, cfg_dict: dict, workspace_dict: dict | None, cache_dir: str) -> None:
    """Pool initializer: load the policy once per worker process, on one thread (the workers share the cores)."""
    global _POLICY
    import torch

    from evoharness.evaluation.evaluate import make_policy

    torch.set_num_threads(1)
    wcfg = TraceConfig(**workspace_dict) if workspace_dict else None
    _POLICY = make_policy(policy, EvalConfig(**cfg_dict), cache_dir, wcfg)


def play_labelled_episode(policy, game: str, index: int, cfg: EvalConfig, cost: CostConfig, tag: str,
                          store_path: str, data_dir: str | None = None,
                          workspace_cfg: TraceConfig | None = None) -> tuple[list[dict], dict]:
    """Play ``game`` with ``policy`` (a ``make_policy`` object) and the harness; return (raw-log records, outcome).

    Records: step 0 plus one per executed command, each with ``expert_action`` (see ``LabellingEnv``); episode id
    ``dagger-<tag>/<game folder>``. Outcome: ``won``, ``env_steps``, ``meta_actions``, ``error``, and ``agreement``,
    the share of commands where the policy did what the expert would have. Never raises for a failing environment:
    the records end with ``error`` set.
    """
    from evoharness.harness.context import turn_view
    from evoharness.harness.workspace import ExperienceStore, Workspace
    from evoharness.policy.agent import run_episode

    episode_id = f"dagger-{tag}/{Path(game).parent}"
    wcfg = getattr(policy, "layout", None) or workspace_cfg or TraceConfig()
    try:
        env = LabellingEnv(ALFWorldEnv(game, max_steps=cfg.max_env_steps + 1, expert=True, data_dir=data_dir),
                           episode_id)
    except Exception as exc:
        return [], {"won": False, "env_steps": 0, "meta_actions": {}, "error": f"could not load game: {exc!r}",
                    "agreement": None}
    ws = Workspace.from_config(ExperienceStore(store_path), f"dagger-{index}", wcfg)
    res = run_episode(env, policy, ws, cost, cfg.max_env_steps, cfg.max_meta_actions, seed=cfg.seed + index,
                      env_timeout_s=cfg.episode_timeout_s, view=turn_view(wcfg))
    env.close()
    records = finish_records(env.records, res.error)
    acts = [r for r in records[1:] if r.get("expert_action")]
    agreement = sum(r["action"] == r["expert_action"] for r in acts) / len(acts) if acts else None
    return records, {"won": res.won, "env_steps": res.env_steps, "meta_actions": res.meta_actions,
                     "error": res.error, "agreement": agreement}


def _worker(args):
    game, index, cfg_dict, cost_dict, tag, store_dir, data_dir, workspace_dict = args
    import os

    t0 = time.time()
    store = str(Path(store_dir) / f"experience-{os.getpid()}.db")  # one Experience store per worker
    records, outcome = play_labelled_episode(
        _POLICY, game, index, EvalConfig(**cfg_dict), CostConfig(**cost_dict), tag, store, data_dir,
        TraceConfig(**workspace_dict) if workspace_dict else None)
    return game, records, outcome | {"wall_s": round(time.time() - t0, 2)}


def collect_dagger(policy: str, games: list[str], out_dir: str | Path, cfg: EvalConfig, cost: CostConfig,
                   tag: str, workers: int = 2, data_dir: str | None = None, workspace_cfg: TraceConfig | None = None,
                   progress=print, shard_size: int = 500) -> dict:
    """Play ``games`` with ``policy`` (any ``evoharness.evaluation.evaluate.make_policy`` string: a model folder or an
    MLflow model URI) in ``workers`` processes and write the expert-labelled logs (module docstring) into ``out_dir``.

    ``cfg``: step/meta-action budgets and decoding, as in evaluation (greedy). ``tag`` names the shards and the
    episode ids. Resumes from ``<out_dir>/dagger-<tag>.partial/`` when a collection with the same policy and
    settings was killed; raises ValueError when that folder holds another policy's or other settings' episodes.
    A finished collection with the same settings (its manifest present, no partial folder) is returned as it is.
    ``progress`` gets one line per episode with the rate and ETA. Returns the manifest: episodes, won, steps,
    labelled steps, policy/expert agreement, wall seconds, and the settings.
    """
    out = Path(out_dir)
    partial = out / f"dagger-{tag}.partial"
    # its own ``workers`` argument plays the games; ``evaluate.workers`` is not a setting of a DAgger collection
    settings = {"policy": policy, "tag": tag, "evaluate": dataclasses.replace(cfg, workers=1).identity(),
                "cost": dataclasses.asdict(cost),
                "workspace": dataclasses.asdict(workspace_cfg) if workspace_cfg else None,
                "games_sha256": hashlib.sha256(json.dumps(games).encode()).hexdigest(), "expert": EXPERT}
    settings = json.loads(json.dumps(settings))
    done_manifest = out / f"dagger-{tag}.json"
    if done_manifest.exists() and not partial.exists():  # finished before (e.g. killed before `dvc add`)
        manifest = json.loads(done_manifest.read_text())
        if manifest["settings"] == settings:
            return manifest | {"wall_s": 0.0, "resumed": len(games)}
    partial.mkdir(parents=True, exist_ok=True)
    ident = partial / "settings.json"
    if ident.exists() and json.loads(ident.read_text()) != settings and any(partial.glob("*.json.done")):
        raise ValueError(f"{partial} holds episodes of {ident.read_text()}, not of {json.dumps(settings)}: "
                         "use another tag, or delete that folder to start over")
    ident.write_text(json.dumps(settings))
    name = {g: f"{i:06d}.json.done" for i, g in enumerate(games)}
    todo = [(g, i) for i, g in enumerate(games) if not (partial / name[g]).exists()]
    if len(todo) < len(games) and progress:
        progress(f"[dagger] resuming in {partial}: {len(games) - len(todo)} of {len(games)} episodes kept")
    t0, finished = time.time(), 0
    if todo:
        jobs = [(g, i, dataclasses.asdict(cfg), dataclasses.asdict(cost), tag, str(partial), data_dir,
                 dataclasses.asdict(workspace_cfg) if workspace_cfg else None) for g, i in todo]
        from evoharness.evaluation.evaluate import resolve_model_path

        local = resolve_model_path(policy, out / "model_cache")  # an MLflow URI is downloaded once, here
        init = (local, dataclasses.asdict(cfg), dataclasses.asdict(workspace_cfg) if workspace_cfg else None,
                str(out / "model_cache"))
        # the expert labels each state: its workers pin Python's hash seed, as collection's do
        with expert_pool(min(workers, len(jobs)), initializer=_init_worker, initargs=init) as pool:
            for game, records, outcome in pool.imap_unordered(_worker, jobs):
                tmp = partial / (name[game] + ".tmp")
                tmp.write_text(json.dumps({"records": records, "outcome": outcome}, sort_keys=True))
                tmp.rename(partial / name[game])
                finished += 1
                if progress:
                    rate = finished / max(time.time() - t0, 1e-9) * 60
                    agree = "-" if outcome["agreement"] is None else f"{outcome['agreement']:.2f}"
                    progress(f"[dagger] {len(games) - len(todo) + finished}/{len(games)} {game}: "
                             f"won={outcome['won']} steps={outcome['env_steps']} agreement={agree}"
                             f" | {rate:.1f} episodes/min, ETA {(len(todo) - finished) / max(rate, 1e-9):.1f} min")
    saved = [json.loads((partial / name[g]).read_text()) for g in games]
    for g, s in zip(games, saved):
        if s["records"] and s["records"][0]["game"] != g:
            raise ValueError(f"{partial / name[g]} holds an episode of {s['records'][0]['game']}, not {g}: delete "
                             f"{partial} to start over")
    episodes = [s["records"] for s in saved if s["records"]]
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for old in (out / "logs").glob(f"dagger-{tag}-*.jsonl"):
        old.unlink()
    for shard, start in enumerate(range(0, len(episodes), shard_size)):
        lines = [json.dumps(r, sort_keys=True) for ep in episodes[start:start + shard_size] for r in ep]
        (out / "logs" / f"dagger-{tag}-{shard:05d}.jsonl").write_text("\n".join(lines) + "\n")
    labelled = [r for ep in episodes for r in ep[1:] if r.get("expert_action")]
    outcomes = [s["outcome"] for s in saved]
    manifest = {
        "settings": settings,
        "games": games,
        "episodes": len(episodes),
        "won": sum(o["won"] for o in outcomes),
        "steps": sum(len(ep) - 1 for ep in episodes),
        "labelled_steps": len(labelled),
        "agreement": sum(r["action"] == r["expert_action"] for r in labelled) / max(len(labelled), 1),
        "failed": sorted((g, s["outcome"]["error"]) for g, s in zip(games, saved)
                         if environment_failed(s["outcome"]["error"])),
    }
    done_manifest.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(partial)
    return manifest | {"wall_s": time.time() - t0, "resumed": len(games) - len(todo)}
