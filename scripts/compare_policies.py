"""Compare evaluation summaries of several policies on one split: a Markdown table and a bar chart by task type.

    python scripts/compare_policies.py --out docs/valid-seen-policies \
        random=runs/issue5/random.json expert=runs/issue5/expert.json plain=runs/issue5/full-plain.json \
        harness=runs/issue5/full.json

Each JSON is what ``flows.evaluate --summary-json`` or ``flows.pipeline --summary-json`` writes. Writes ``OUT.md``
(the table) and ``OUT.png`` (success by task type; meta-actions, malformed and rejected turns per episode; generated
tokens per episode); prints the table. ``--history NAME=history.jsonl`` (GRPO runs' per-step rollout metrics, as
``evoharness.training.rollouts.log_step`` writes them) adds a panel of meta-actions per episode by GRPO step, one line
per run. With ``--mlflow-run RUN_ID`` both files are also logged as artifacts of that run. Exits 2 when the summaries
are not on the same split and number of games.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python scripts/compare_policies.py`
from evoharness.training.rollouts import read_history  # noqa: E402

TYPES = ("Pick", "Clean", "Heat", "Cool", "Look", "Pick Two")
META = ("track", "commit", "recall", "note")


def table(summaries: dict[str, dict]) -> str:
    """Markdown: success rate by task type and overall, then mean steps, meta-actions, malformed and rejected turns
    ("-" for a summary that predates the count) and generated tokens per episode."""
    head = ["policy", *TYPES, "All", "mean steps", *[f"{m}/ep" for m in META], "malformed/ep", "rejected/ep",
            "tokens/ep"]
    first = next(iter(summaries.values()))
    counts = first["episodes_by_task_type"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head),
             "| games | " + " | ".join(str(counts.get(t, 0)) for t in TYPES) + f" | {first['episodes']} |"
             + " |" * (len(head) - len(TYPES) - 2)]
    for name, s in summaries.items():
        by = s["success_by_task_type"]
        cells = [f"{100 * by[t]:.1f}" if t in by else "-" for t in TYPES]
        cells.append(f"**{100 * s['success_rate']:.1f}**")
        cells.append(f"{s['mean_steps']:.1f}")
        cells += [f"{s['meta_actions_per_episode'].get(m, 0):.2f}" for m in META]
        cells += [f"{s[k]:.2f}" if s.get(k) is not None else "-"  # rejected turns: counted since issue 6's rerun
                  for k in ("malformed_per_episode", "rejected_turns_per_episode")]
        cells.append(f"{s.get('generated_tokens_per_episode', 0):.0f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nSuccess in % of games (ALFWorld's `won`).\n"


def _bars(ax, summaries: dict[str, dict], groups: list[str], value) -> None:
    import matplotlib

    width = 0.8 / len(summaries)
    # matplotlib's default cycle repeats after 10 colours; tab20 keeps up to 20 policies apart
    cmap = matplotlib.colormaps["tab20"] if len(summaries) > 10 else None
    for i, (name, s) in enumerate(summaries.items()):
        ax.bar([g + i * width for g in range(len(groups))], [value(s, k) for k in groups], width, label=name,
               color=cmap(i % 20) if cmap else None)
    ax.set_xticks([g + width * (len(summaries) - 1) / 2 for g in range(len(groups))], groups)


def figure(summaries: dict[str, dict], histories: dict[str, list[dict]] | None = None):
    """Matplotlib figure, one bar per policy: success rate (%) by task type and overall; meta-actions per episode
    by type with malformed and rejected turns; generated tokens per episode. With ``histories`` a last panel plots
    meta-actions per episode by GRPO step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 4 if histories else 3
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.8),
                             gridspec_kw={"width_ratios": [3, 2.5, 1, 2][:panels]})
    first = next(iter(summaries.values()))
    _bars(axes[0], summaries, [*TYPES, "All"],
          lambda s, k: 100 * (s["success_rate"] if k == "All" else s["success_by_task_type"].get(k, 0.0)))
    axes[0].set_ylabel("success %"), axes[0].set_ylim(0, 100)
    axes[0].set_title(f"{first['split']}: {first['episodes']} games")
    extra = {"malformed": "malformed_per_episode", "rejected": "rejected_turns_per_episode"}
    _bars(axes[1], summaries, [*META, *extra],
          lambda s, k: s["meta_actions_per_episode"].get(k, 0) if k in META else (s.get(extra[k]) or 0.0))
    axes[1].set_title("meta-actions and rejected turns / episode")
    _bars(axes[2], summaries, ["tokens"], lambda s, k: s.get("generated_tokens_per_episode", 0))
    axes[2].set_title("generated tokens / episode")
    if histories:
        for name, h in histories.items():
            axes[3].plot([x["step"] for x in h], [x["meta_actions"] for x in h], marker="o", label=name)
        axes[3].set_xlabel("GRPO step"), axes[3].set_title("meta-actions / episode in rollouts")
        axes[3].legend(fontsize=8)
    rows = -(-len(summaries) // 6)  # the policies' legend below the panels, 6 to a row, over no bar
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(len(summaries), 6), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 * rows, 1, 1))
    return fig


def _named_paths(items: list[str], what: str) -> dict[str, str] | None:
    """``NAME=path`` arguments as {name: path}; None (with the reason on stderr) when one is malformed or missing."""
    out = {}
    for item in items:
        name, _, path = item.partition("=")
        if not path or not Path(path).exists():
            print(f"{item!r}: expected NAME=path/to/{what} of an existing file", file=sys.stderr)
            return None
        out[name] = path
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("summaries", nargs="+", help="NAME=summary.json, in table order")
    p.add_argument("--out", required=True, help="output path without suffix (writes .md and .png)")
    p.add_argument("--mlflow-run", default=None, help="also log both files to this MLflow run")
    p.add_argument("--history", action="append", default=[],
                   help="NAME=history.jsonl of a GRPO run (repeatable): meta-actions per episode by step")
    a = p.parse_args(argv)
    summary_paths, history_paths = _named_paths(a.summaries, "summary.json"), _named_paths(a.history, "history.jsonl")
    if summary_paths is None or history_paths is None:
        return 2
    summaries = {name: json.loads(Path(path).read_text()) for name, path in summary_paths.items()}
    histories = {name: read_history(path) for name, path in history_paths.items()}
    keys = {(s["split"], s["episodes"]) for s in summaries.values()}
    if len(keys) != 1:
        print(f"summaries differ in split or number of games: {sorted(keys)}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = table(summaries)
    out.with_suffix(".md").write_text(md)
    figure(summaries, histories).savefig(out.with_suffix(".png"), dpi=110)
    if a.mlflow_run:
        import mlflow

        from evoharness.registry.tracking import configure

        configure(str(Path(__file__).resolve().parent.parent))
        with mlflow.start_run(run_id=a.mlflow_run):
            mlflow.log_artifact(str(out.with_suffix(".md")))
            mlflow.log_artifact(str(out.with_suffix(".png")))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
