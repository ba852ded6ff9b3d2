"""Playing games with a policy in one process: the policy built from its name or path, each episode appended to
``transcripts.jsonl`` as it ends, and an interrupted folder resumed (``play_games``). ``evoharness.evaluation.evaluate``
runs it in one process or, through ``evoharness.evaluation.workers``, in several, and summarizes the episodes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

from evoharness.config import CostConfig, EvalConfig, TraceConfig
from evoharness.env.alfworld import EXPERT, ALFWorldEnv
from evoharness.harness.context import turn_view, with_layout
from evoharness.harness.workspace import META_ACTIONS, ExperienceStore, Workspace


def resolve_model_path(policy: str, cache_dir: str | Path) -> str:
    """A local folder for ``policy``: MLflow URIs are downloaded to ``cache_dir``; other strings pass through."""
    if policy.startswith(("models:/", "runs:/", "mlflow-artifacts:/")):
        import mlflow

        local = mlflow.artifacts.download_artifacts(artifact_uri=policy, dst_path=str(cache_dir))
        # mlflow.transformers stores the weights under model/ and the tokenizer under components/tokenizer/
        model_dir, tok_dir = Path(local) / "model", Path(local) / "components" / "tokenizer"
        if model_dir.is_dir() and tok_dir.is_dir():
            for f in tok_dir.iterdir():
                (model_dir / f.name).write_bytes(f.read_bytes())
            return str(model_dir)
        return local
    return policy


def make_policy(policy: str, cfg: EvalConfig, cache_dir: str | Path, workspace_cfg: TraceConfig | None = None):
    """Build a policy object for ``run_episode`` from its name or path (see module docstring). A language model
    reads the context layout it was trained on (``workspace_cfg.context``) and decodes with ``cfg.decoding``."""
    from evoharness.policy.agent import ExpertPolicy, RandomPolicy

    if policy == "expert":
        return ExpertPolicy()
    if policy == "random":
        return RandomPolicy(cfg.seed)
    import torch

    from evoharness.policy.lm_policy import LMPolicy
    from evoharness.training.model import load_policy

    on_gpu = torch.cuda.is_available()
    model, tokenizer = load_policy(resolve_model_path(policy, cache_dir), dtype="bfloat16" if on_gpu else "float32")
    model.to("cuda" if on_gpu else "cpu").eval()
    from evoharness.harness.workspace import TOOLS

    wcfg = with_layout(workspace_cfg or TraceConfig(), model.config)
    pol = LMPolicy(model, tokenizer, cfg.max_new_tokens, temperature=0.0, context=wcfg.context,
                   decoding=cfg.decoding if wcfg.context == "turn" else "remap",
                   tools=TOOLS if wcfg.tools_in_prompt else None,
                   act_each_turn=cfg.act_each_turn and wcfg.parallel_calls, ground_track=cfg.ground_track)
    pol.layout = wcfg  # the workspace and prompt layout this model reads (from its config when recorded)
    return pol


ENVIRONMENT_FAILURES = ("could not load game", "reset failed", "env.step(")


def environment_failed(error: str | None) -> bool:
    """Whether an episode's ``error`` says the environment, not the policy, failed (the game would not load or
    reset, or a step raised): such an episode says nothing about the policy and is played again on resume.
    "turn budget spent" and "context window full" are the policy's outcomes, not failures."""
    return bool(error) and error.startswith(ENVIRONMENT_FAILURES)


def resumable(out: Path, identity: dict, progress) -> dict:
    """The episodes already written to ``out/transcripts.jsonl`` by an evaluation with the same ``identity``
    (policy and settings), by game. A line that is not a whole episode (cut short by a killed process, or from an
    older ``EpisodeResult``) is dropped, and its game is played again. Raises ValueError naming the folder when it
    holds another policy's or other settings' evaluation, or episodes without ``evaluation.json`` (whose policy
    cannot be told)."""
    from evoharness.policy.agent import EpisodeResult

    meta, file = out / "evaluation.json", out / "transcripts.jsonl"
    has_rows = file.exists() and file.stat().st_size > 0
    if meta.exists():
        try:
            recorded = json.loads(meta.read_text())
        except json.JSONDecodeError:
            recorded = None
        if recorded != identity and has_rows:
            raise ValueError(f"{out} holds an evaluation of {meta.read_text()}, not of {json.dumps(identity)}: "
                             "evaluate into another folder, or delete this one to start over")
    elif has_rows:
        raise ValueError(f"{file} holds episodes but {meta} is missing, so which policy and settings played them "
                         "cannot be told: evaluate into another folder, or delete this one to start over")
    rows = {}  # game -> EpisodeResult
    if has_rows:
        text = file.read_text()
        for i, line in enumerate(text.splitlines(), 1):
            try:
                row = EpisodeResult(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                if line.strip() and progress:
                    progress(f"[evaluate] {file}:{i}: not a whole episode (a killed run?); its game is played again")
                continue
            rows[row.game] = row
        if not text.endswith("\n"):
            with file.open("a") as fh:  # new rows start on a line of their own
                fh.write("\n")
    return rows


def evaluation_identity(policy: str, cfg: EvalConfig, cost: CostConfig, workspace_cfg: TraceConfig | None,
                        identity: str | None = None) -> dict:
    """What ``evaluation.json`` records: the policy (``identity`` or ``policy``), settings, costs and workspace
    layout, and for the ``expert`` policy which expert (``env.alfworld.EXPERT``), as they read back from JSON; an
    evaluation resumes only into a folder with the same."""
    ident = {"policy": identity or policy, "settings": cfg.identity(), "cost": cost.identity(),
             "workspace": dataclasses.asdict(workspace_cfg) if workspace_cfg else None}
    if policy == "expert":
        ident["expert"] = EXPERT
    return json.loads(json.dumps(ident))  # tuples become lists


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def play_games(policy: str, games: list[str], cfg: EvalConfig, cost: CostConfig, out: Path,
               experience_path: str | None = None, data_dir: str | None = None, progress=print,
               workspace_cfg: TraceConfig | None = None, identity: str | None = None,
               indices: list[int] | None = None, label: str = "evaluate") -> tuple[list, dict]:
    """One process of ``evaluate``: play ``games`` in order into ``out`` (resuming there, see ``evaluate``).

    ``indices``: each game's position in the whole evaluation (default 0, 1, ...), which seeds its episode
    (``cfg.seed`` + index) and names its workspace, as in one process (what a policy recalls, and ``random``'s
    draws, still depend on the episodes played before it in the same process). ``cfg.batch_episodes`` > 1 (a
    language-model policy): that many episodes play at once, their model calls batched
    (``evoharness.policy.batched_play``). Returns the ``EpisodeResult`` of each game in ``games`` order and
    ``{"resumed_episodes", "decoding", "forced_acts", "context", "wall_s"}``."""
    indices = list(range(len(games))) if indices is None else indices
    out.mkdir(parents=True, exist_ok=True)
    ident = evaluation_identity(policy, cfg, cost, workspace_cfg, identity)
    done = resumable(out, ident, progress)
    wanted = set(games)
    keep = {g: r for g, r in done.items() if g in wanted and not environment_failed(r.error)}
    if keep and progress:
        replay = sum(g in done and g not in keep for g in games)
        progress(f"[{label}] resuming in {out}: {len(keep)} of {len(games)} episodes kept, "
                 f"{len(games) - len(keep)} to play ({replay} of them after an environment failure)")
    if keep and (out / "experience.db").exists():
        store = ExperienceStore(out / "experience.db")  # the notes the kept episodes wrote
    elif experience_path and Path(experience_path).exists():
        store = ExperienceStore(experience_path).copy_to(out / "experience.db")
    else:
        store = ExperienceStore(out / "experience.db")
    pol = make_policy(policy, cfg, out / "model_cache", workspace_cfg)
    write_atomic(out / "evaluation.json", json.dumps(ident))  # once the policy has loaded
    wcfg = getattr(pol, "layout", None) or workspace_cfg or TraceConfig()
    results, t0 = [], time.time()
    batched = cfg.batch_episodes > 1 and hasattr(pol, "engine")
    todo = [(n, i, g) for n, (i, g) in enumerate(zip(indices, games)) if g not in keep]
    lock, counts = threading.Lock(), {"played": 0, "won": sum(r.won for r in keep.values())}
    with (out / "transcripts.jsonl").open("a") as fh:
        def finished(n: int, res) -> None:  # one episode ended: append it, report progress
            with lock:
                fh.write(json.dumps(res.__dict__) + "\n")
                fh.flush()
                counts["played"] += 1
                counts["won"] += res.won
                rate = counts["played"] / (time.time() - t0) * 60
                if progress:
                    left = len(todo) - counts["played"]
                    progress(f"[{label}] {len(keep) + counts['played']}/{len(games)} won={counts['won']} "
                             f"{rate:.1f} episodes/min, ETA {left / max(rate, 1e-9):.1f} min")

        if batched:
            from evoharness.policy.batched_play import lane_policy, run_lanes

            lanes: list[dict] = []

            def play_lane(job, lane):  # runs in the lane's thread, where its store connection must be opened
                if not lane.state:
                    lane.state.update(policy=lane_policy(pol, lane.engine),
                                      store=ExperienceStore(out / "experience.db"))
                    lanes.append(lane.state)
                return _play_one(lane.state["policy"], job[1], job[2], cfg, cost, lane.state["store"], wcfg, data_dir,
                                 policy, lane.make_env)

            rows = run_lanes(pol.model, pol.tok, todo, cfg.batch_episodes, cfg.env_recycle_every, play_lane,
                             lambda job, res: finished(job[0], res))
            played = {job[2]: res for job, res in zip(todo, rows)}
            forced = sum(st["policy"].forced for st in lanes)
        else:
            played, forced = {}, None
            for n, i, game in todo:
                played[game] = _play_one(pol, i, game, cfg, cost, store, wcfg, data_dir, policy)
                finished(n, played[game])
        results = [keep[g] if g in keep else played[g] for g in games]
    # one row per game, in game order (rows of games not in ``games`` are kept after them)
    extra = [r for g, r in done.items() if g not in wanted]
    write_atomic(out / "transcripts.jsonl", "".join(json.dumps(r.__dict__) + "\n" for r in results + extra))
    return results, {"resumed_episodes": len(keep), "decoding": getattr(pol, "decoding", None),
                     "forced_acts": getattr(pol, "forced", 0) if forced is None else forced,
                     "context": wcfg.context, "wall_s": time.time() - t0}


def _play_one(pol, i: int, game: str, cfg: EvalConfig, cost: CostConfig, store, wcfg: TraceConfig,
              data_dir: str | None, policy: str, make_env=None):
    """One episode of ``game`` (position ``i`` of the evaluation: its seed and workspace name) by ``pol``; a game
    that cannot be loaded gives an unwon ``EpisodeResult`` with ``error`` set. ``make_env(game, max_steps, expert,
    data_dir)`` builds the environment (default ``ALFWorldEnv``, in this process)."""
    from evoharness.policy.agent import EpisodeResult, run_episode

    try:
        env = (make_env or ALFWorldEnv)(game, cfg.max_env_steps + 1, policy == "expert", data_dir)
    except Exception as exc:
        return EpisodeResult(game, "", False, 0, {m: 0 for m in META_ACTIONS}, 0, 0.0, 0.0,
                             error=f"could not load game: {exc!r}", grounded_names=0)
    ws = Workspace.from_config(store, f"eval-{i}", wcfg)
    try:
        return run_episode(env, pol, ws, cost, cfg.max_env_steps, cfg.max_meta_actions, seed=cfg.seed + i,
                           env_timeout_s=cfg.episode_timeout_s, view=turn_view(wcfg))
    finally:
        env.close()
