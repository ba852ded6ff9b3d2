"""The model card of a release (``README.md`` in its folder), in the Hugging Face model-card layout: YAML metadata
(``model-index`` results) then Model details, How to use, Training, Evaluation, Limitations
(https://huggingface.co/docs/hub/model-cards). Every figure comes from ``release.json`` and the evaluation
summary; ``card_figures`` reads them back, so a test can hold the card to the summary."""

from __future__ import annotations

import re

from evoharness.harness.workspace import META_ACTIONS

TASK_ORDER = ("Pick", "Clean", "Heat", "Cool", "Look", "Pick Two")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def results_rows(summary: dict) -> list[tuple[str, int, int, float]]:
    """(task type, games, won, success rate) per task type in ALFWorld's order, then ``All``."""
    rows = []
    types = [t for t in TASK_ORDER if t in summary["success_by_task_type"]]
    types += sorted(set(summary["success_by_task_type"]) - set(types))
    for t in types:
        n = summary["episodes_by_task_type"][t]
        rows.append((t, n, round(summary["success_by_task_type"][t] * n), summary["success_by_task_type"][t]))
    n = summary["episodes"]
    rows.append(("All", n, round(summary["success_rate"] * n), summary["success_rate"]))
    return rows


def render_card(release: dict, summary: dict) -> str:
    """The card's Markdown for ``release`` (``release.json``'s content) and its evaluation ``summary``."""
    lin, tr, ev, name = release["lineage"], release["training"], release["evaluate"], release["name"]
    traces = release["traces"]
    split = summary["split"]
    all_row = results_rows(summary)[-1]
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [evoharness, alfworld, agent, tool-calling, qwen3]",
        "model-index:",
        f"- name: {name}",
        "  results:",
        "  - task: {type: text-generation, name: ALFWorld embodied tasks}",
        f"    dataset: {{type: alfworld, name: ALFWorld {split}, split: {split}}}",
        "    metrics:",
        f"    - {{type: success_rate, value: {_pct(summary['success_rate'])}, name: success rate (%)}}",
        "---",
        "",
        f"# {name}",
        "",
        "An EvoHarness policy: a small Qwen3-architecture language model that plays ALFWorld text games and manages "
        "its own BPE workspace (Belief, Progress, Experience) with the meta-actions `track`, `commit`, `recall` and "
        "`note` beside its environment actions.",
        "",
        "## Model details",
        "",
        f"- Architecture: Qwen3 (`Qwen3ForCausalLM`), {tr['parameters']:,} parameters, "
        f"{_base(lin, release.get('parent'))}; byte-level "
        "BPE tokenizer trained on the project's own traces; Qwen3 chat template with tool calls.",
        f"- Context layout: `{tr.get('layout', {}).get('context', 'turn')}` "
        f"(recorded in `config.json` as `evoharness_layout`; evaluation prompts the model the same way).",
        f"- Training: {lin.get('trained_until', 'sft').upper()} (supervised harness fine-tuning on BPE traces"
        f"{'' if lin.get('trained_until', 'sft') == 'sft' else ', then cost-aware GRPO'}).",
        "",
        "## How to use",
        "",
        "```bash",
        f"make evaluate ARGS=\"--policy models/{name}\"          # its {split} figures below, with its own settings",
        f"make evaluate ARGS=\"--policy models/{name} --split valid_train --limit 20\"",
        f"make register-release RELEASE=models/{name}          # into the local MLflow registry, lineage as tags",
        "```",
        "",
        "It plays with the settings in `release.json` unless told otherwise: "
        f"{ev['max_env_steps']} environment steps at most (ALFWorld's limit), {ev['max_meta_actions']} meta-actions, "
        f"`{ev['decoding']}` decoding (greedy), {ev['max_new_tokens']} new tokens a turn, "
        f"`ground_track` {str(ev['ground_track']).lower()}, {ev['workers']} worker processes, the Experience store "
        "`experience.db`.",
        "",
        "## Training",
        "",
        "| what | value |",
        "| --- | --- |",
        f"| command | `{release['command']}` |",
        f"| git commit | `{lin.get('git_commit')}` (dirty: {lin.get('git_dirty')}) |",
        f"| profile | `{lin.get('profile')}` |",
        f"| config digest | `{lin.get('config_digest')}` |",
        f"| data | `{lin.get('data_path')}` (DVC md5 `{lin.get('dvc_md5')}`) |",
        f"| trace hash | `{lin.get('trace_hash')}` |",
        f"| trace examples{' (collected by the run; GRPO trains on its own rollouts)' if release.get('grpo') else ''}"
        f" | {traces.get('train_rows', 0):,} train, {traces.get('valid_rows', 0):,} validation, from "
        f"{traces.get('kept', 0):,} won of {traces.get('episodes', 0):,} episodes |",
        f"| parameters | {tr['parameters']:,} |",
        *(_grpo_rows(release, tr) if release.get("grpo") else _parent_rows(release.get("parent"), tr)),
        f"| precision | {tr.get('precision', '')} |",
        f"| machine | {tr.get('machine', '')} |",
        "",
        f"## Evaluation: all {summary['episodes']} `{split}` games, greedy",
        "",
        "| task type | games | won | success (%) |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {t} | {n} | {w} | {_pct(s)} |" for t, n, w, s in results_rows(summary)]
    meta = summary["meta_actions_per_episode"]
    by_type = [(s, t) for t, n, w, s in results_rows(summary) if t != "All" and n]
    weakest = f" ({min(by_type)[1]} is its weakest task type here)" if by_type else ""
    lines += [
        "",
        "Per episode:",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| environment steps | {summary['mean_steps']:.2f} |",
        *[f"| `{m}` calls | {meta[m]:.2f} |" for m in META_ACTIONS],
        f"| generated tokens | {summary['generated_tokens_per_episode']:.1f} |",
        f"| malformed turns | {summary['malformed_per_episode']:.2f} |",
        f"| rejected turns | {summary['rejected_turns_per_episode']:.2f} |",
        "",
        *_paired_lines(release.get("parent")),
        f"{all_row[2]} of {all_row[1]} won. Per-game outcomes: `evaluation/{split}.json` (`won_by_game`), per-episode "
        f"results: `evaluation/{split}-episodes.jsonl`.",
        "",
        "## Limitations",
        "",
        f"- A {tr['parameters'] / 1e6:.0f}M-parameter model trained from scratch on ALFWorld's handcoded expert"
        f"{', then by GRPO on its own rollouts' if release.get('grpo') else ''}: it knows these text games only, "
        f"and inherits the expert's weaknesses{weakest}.",
        f"- Figures are for one training seed (`{lin.get('profile')}`); the spread between seeds of the same recipe is "
        "in the project's `docs/experiments/`.",
        "- Greedy choices can differ between CPUs (float kernels, bf16 or fp32 training): an evaluation on another "
        "machine can differ by a few games.",
        "",
    ]
    return "\n".join(lines)


def card_figures(card: str) -> dict:
    """The figures a card states, read back from its Markdown: ``rows`` {task type: (games, won, success %)} and
    ``per_episode`` {measure: value}. Raises ValueError when the evaluation table is absent."""
    rows, per_episode, section = {}, {}, None
    for line in card.splitlines():
        if line.startswith("## "):
            section = line
        m = re.match(r"\| ([A-Za-z ]+) \| (\d+) \| (\d+) \| ([\d.]+) \|$", line)
        if m and section and section.startswith("## Evaluation"):
            rows[m.group(1)] = (int(m.group(2)), int(m.group(3)), float(m.group(4)))
        m = re.match(r"\| `?([a-z ]+?)`?( calls)? \| ([\d.]+) \|$", line)
        if m and section and section.startswith("## Evaluation"):
            per_episode[m.group(1)] = float(m.group(3))
    if not rows:
        raise ValueError("no evaluation table (| task type | games | won | success (%) |) in the card")
    return {"rows": rows, "per_episode": per_episode}


def _base(lin: dict, parent: dict | None) -> str:
    """What the card says the model was trained from."""
    if parent:
        return (f"trained further from the release `{parent['name']}` as of commit "
                f"`{(parent['git_commit'] or '?')[:7]}` (profile `{parent['profile']}`)")
    if lin.get("base_model") in (None, "", "embedded-default"):
        return "trained from scratch"
    return f"trained from `{lin['base_model']}`"


def _parent_row(parent: dict) -> str:
    """The card's row naming the parent release: its name, the commit holding its weights, its command and rates."""
    rates = ", ".join(f"{_pct(v)} % of `{k}`" for k, v in parent["success_rate"].items())
    return f"| parent release | `{parent['name']}` at `{parent['git_commit']}`: `{parent['command']}` ({rates}) |"


def _parent_rows(parent: dict | None, tr: dict) -> list[str]:
    """The training rows of the card's lineage table: this run's, and with a parent release, the totals."""
    if not parent:
        return [f"| training steps | {tr['steps']:,} |", f"| training tokens | {tr['tokens']:,} |",
                f"| training wall time | {tr['train_seconds']:,.0f} s |"]
    return [_parent_row(parent),
            f"| training steps | {tr['steps']:,} here, {tr['steps'] + parent['steps']:,} in all |",
            f"| training tokens | {tr['tokens']:,} here, {tr['tokens'] + parent['tokens']:,} in all |",
            f"| training wall time | {tr['train_seconds']:,.0f} s here, "
            f"{tr['train_seconds'] + parent['train_seconds']:,.0f} s in all |"]


def _prices(c: dict) -> str:
    """The priced cost's prices of a release's cost config, as the card states them."""
    return (f"per call {c['per_call']}, per call token {c['per_call_token']:g}, "
            f"per generated token {c['per_generated_token']:g}")


def _grpo_rows(release: dict, tr: dict) -> list[str]:
    """The training rows of a policy trained further by cost-aware GRPO: its parent release, the GRPO run (updates,
    rollouts, generated tokens, wall time), the reward it maximised and the GRPO settings, then the totals."""
    g, c, parent = release["grpo"], release["cost"], release.get("parent")
    if c.get("mode") == "budget":
        reward = (f"`budget` (EvoHarness-RL): task {c['task_reward']:g} for a win, efficiency {c['lambda_eff']:g} x "
                  f"unused share of T_max = {c['interaction_budget']}"
                  f"{' (each meta-action spends one unit)' if c['charge_meta_actions'] else ''}, diversity "
                  f"{c['lambda_div0']:g} cosine-annealed to 0 over {c['anneal_updates']} updates, repeats -"
                  f"{c['lambda_spam']:g} (at most {c['spam_cap']}), invalid actions -{c['lambda_inv']:g} each")
        if c.get("charge_priced"):
            reward += f"; and the priced cost charged on top ({_prices(c)})"
    else:
        reward = f"`priced`: 1 for a win minus the cost of calls ({_prices(c)})"
    gigpo = (f" (step-level groups over repeated states, gamma {g['gigpo_gamma']:g}, omega {g['gigpo_omega']:g})"
             if g["advantage"] == "gigpo" else "")
    rows = [_parent_row(parent)] if parent else []
    rows += [f"| GRPO | {tr['steps']:,} updates of {g['prompts_per_step']} `{g['split']}` games x "
             f"{g['num_generations']} episodes ({tr['episodes']:,} rollouts; games from index {g['game_offset']}, "
             f"{g['num_games']} in the pool), {tr['world_size']} processes |",
             f"| reward | {reward} |",
             f"| advantage | `{g['advantage']}`{gigpo}; "
             f"every turn of a group trained (at most {g['turns_per_group']}), lr {g['learning_rate']:g}, KL beta "
             f"{g['beta']:g}, temperature {g['temperature']:g} |",
             f"| tokens generated in GRPO rollouts | {tr['tokens']:,} |"]
    if parent:
        rows += [f"| training steps | {tr['steps']:,} GRPO updates here, {tr['steps'] + parent['steps']:,} in all |",
                 f"| training wall time | {tr['train_seconds']:,.0f} s of GRPO here, "
                 f"{tr['train_seconds'] + parent['train_seconds']:,.0f} s in all |"]
    elif tr.get("sft_steps"):  # SFT and GRPO in the same run
        rows += [f"| training steps | {tr['sft_steps']:,} SFT steps ({tr['sft_tokens']:,} tokens), then "
                 f"{tr['steps']:,} GRPO updates |",
                 f"| training wall time | {tr['sft_seconds']:,.0f} s of SFT, {tr['train_seconds']:,.0f} s of GRPO |"]
    else:
        rows += [f"| training steps | {tr['steps']:,} GRPO updates |",
                 f"| training wall time | {tr['train_seconds']:,.0f} s of GRPO |"]
    return rows


def _paired_lines(parent: dict | None) -> list[str]:
    """The card's paired comparison with its parent release on the games both played (exact McNemar test)."""
    t = (parent or {}).get("paired_test")
    if not t:
        return []
    return [f"Against its parent release `{parent['name']}` on the same {t['games']} `{t['split']}` games (its "
            f"recorded evaluation): {t['both']} won by both, {t['only_a']} only by this policy, {t['only_b']} only "
            f"by the parent, exact McNemar p = {t['p']:.3g}.", ""]
