"""Evaluation: play a split's games with a policy and report ALFWorld success (``won``, never ``done``).

Policies: ``expert`` (ALFWorld's handcoded expert), ``random`` (uniform admissible), a local model folder, a hub id,
or an MLflow model URI (``models:/NAME@ALIAS``, ``models:/m-<id>``, ``runs:/...``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from evoharness.alfworld_env import TASK_TYPES, ALFWorldEnv
from evoharness.config import CostConfig, EvalConfig, TraceConfig
from evoharness.context import turn_view, with_layout
from evoharness.harness import META_ACTIONS, ExperienceStore, Workspace


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
    from evoharness.agent import ExpertPolicy, RandomPolicy

    if policy == "expert":
        return ExpertPolicy()
    if policy == "random":
        return RandomPolicy(cfg.seed)
    import torch

    from evoharness.lm_policy import LMPolicy
    from evoharness.model import load_policy

    on_gpu = torch.cuda.is_available()
    model, tokenizer = load_policy(resolve_model_path(policy, cache_dir), dtype="bfloat16" if on_gpu else "float32")
    model.to("cuda" if on_gpu else "cpu").eval()
    from evoharness.harness import TOOLS

    wcfg = with_layout(workspace_cfg or TraceConfig(), model.config)
    pol = LMPolicy(model, tokenizer, cfg.max_new_tokens, temperature=0.0, context=wcfg.context,
                   decoding=cfg.decoding if wcfg.context == "turn" else "remap",
                   tools=TOOLS if wcfg.tools_in_prompt else None)
    pol.layout = wcfg  # the workspace and prompt layout this model reads (from its config when recorded)
    return pol


def spread(games: list[str], limit: int) -> list[str]:
    """``limit`` games at evenly spaced positions of the sorted list (all task types, not just the first
    folder's); ``limit`` 0 or >= len(games) gives every game."""
    if not limit or limit >= len(games):
        return list(games)
    return [games[i * len(games) // limit] for i in range(limit)]


def summarize(results, split: str, games_total: int) -> dict:
    """Success rate overall and by task type; mean steps, meta-actions (by type) and generated tokens per episode."""
    n = max(len(results), 1)
    by_type: dict[str, list[bool]] = {}
    meta_by_type: dict[str, list[dict]] = {}
    for r in results:
        by_type.setdefault(TASK_TYPES.get(r.task_type, r.task_type), []).append(r.won)
        meta_by_type.setdefault(TASK_TYPES.get(r.task_type, r.task_type), []).append(r.meta_actions)
    return {
        "split": split,
        "episodes": len(results),
        "games_in_split": games_total,
        "success_rate": sum(r.won for r in results) / n,
        "success_by_task_type": {k: sum(v) / len(v) for k, v in sorted(by_type.items())},
        "episodes_by_task_type": {k: len(v) for k, v in sorted(by_type.items())},
        "mean_steps": sum(r.env_steps for r in results) / n,
        "meta_actions_per_episode": {m: sum(r.meta_actions.get(m, 0) for r in results) / n for m in META_ACTIONS},
        "meta_actions_by_task_type": {t: {m: sum(x.get(m, 0) for x in v) / len(v) for m in META_ACTIONS}
                                      for t, v in sorted(meta_by_type.items())},
        "generated_tokens_per_episode": sum(r.generated_tokens for r in results) / n,
        "cost_per_episode": sum(r.cost for r in results) / n,
        "cost_per_episode_by_type": {m: sum(r.cost_by_type.get(m, 0.0) for r in results) / n for m in META_ACTIONS},
        "malformed_per_episode": sum(r.malformed for r in results) / n,
        "rejected_turns_per_episode": sum(r.rejected_turns for r in results) / n,
        "remapped_per_episode": sum(r.remapped for r in results) / n,
        "mean_reward": sum(r.reward for r in results) / n,
        "errors": [f"{r.game}: {r.error}" for r in results if r.error],
    }


def evaluate(policy: str, games: list[str], cfg: EvalConfig, cost: CostConfig, out_dir: str | Path,
             experience_path: str | None = None, data_dir: str | None = None, games_total: int | None = None,
             progress=print, workspace_cfg: TraceConfig | None = None) -> dict:
    """Play each game once with ``policy``; write ``transcripts.jsonl`` and return the summary dict.

    ``experience_path``: an Experience store to start from (copied, so evaluation never changes it).
    An environment that raises ends that episode as failed (``errors`` in the summary); the run continues.
    """
    from evoharness.agent import run_episode

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if experience_path and Path(experience_path).exists():
        store = ExperienceStore(experience_path).copy_to(out / "experience.db")
    else:
        store = ExperienceStore(out / "experience.db")
    pol = make_policy(policy, cfg, out / "model_cache", workspace_cfg)
    wcfg = getattr(pol, "layout", None) or workspace_cfg or TraceConfig()
    results, t0 = [], time.time()
    split = Path(games[0]).parts[0] if games else cfg.split
    with (out / "transcripts.jsonl").open("w") as fh:
        for i, game in enumerate(games):
            try:
                env = ALFWorldEnv(game, max_steps=cfg.max_env_steps + 1, expert=policy == "expert",
                                  data_dir=data_dir)
            except Exception as exc:
                from evoharness.agent import EpisodeResult

                res = EpisodeResult(game, "", False, 0, {m: 0 for m in META_ACTIONS}, 0, 0.0, 0.0,
                                    error=f"could not load game: {exc!r}")
            else:
                ws = Workspace.from_config(store, f"eval-{i}", wcfg)
                res = run_episode(env, pol, ws, cost, cfg.max_env_steps, cfg.max_meta_actions, seed=cfg.seed + i,
                                  env_timeout_s=cfg.episode_timeout_s, view=turn_view(wcfg))
                env.close()
            results.append(res)
            fh.write(json.dumps(res.__dict__) + "\n")
            rate = (i + 1) / (time.time() - t0) * 60
            if progress:
                progress(f"[evaluate] {i + 1}/{len(games)} won={sum(r.won for r in results)} "
                         f"{rate:.1f} episodes/min, ETA {(len(games) - i - 1) / max(rate, 1e-9):.1f} min")
    summary = summarize(results, split, games_total or len(games))
    summary["policy"] = policy
    summary["decoding"] = getattr(pol, "decoding", None)
    summary["forced_acts"] = getattr(pol, "forced", 0)
    summary["context"] = wcfg.context
    summary["wall_s"] = time.time() - t0
    return summary
