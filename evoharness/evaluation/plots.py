"""Figures logged as MLflow artifacts."""

from __future__ import annotations


def annealing_figure(history: list[dict]):
    """Matplotlib figure of GRPO's per-step rollout metrics (``evoharness.training.rollouts.episode_metrics``), 2 x 2
    panels:
    success rate, reward and cost; meta-actions per episode by type and malformed turns (harness annealing, and
    what replaced the calls); environment steps and
    generated tokens per episode; the rendered workspace's largest size per episode in tokens (harness evolution)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(10, 6.5))
    for key in ("success_rate", "reward", "cost"):
        a.plot(steps, [h[key] for h in history], marker="o", label=key)
    a.legend(), a.set_title("success, reward, cost (per episode)")
    for m in ("track", "commit", "recall", "note"):
        b.plot(steps, [h[f"meta_actions_{m}"] for h in history], marker="o", label=m)
    b.plot(steps, [h.get("malformed", 0) for h in history], "k--", label="malformed turns")
    b.plot(steps, [h.get("rejected_turns", 0) for h in history], "k:", label="rejected turns (charged)")
    b.set_ylabel("per episode"), b.legend(), b.set_title("harness annealing: meta-actions")
    c.plot(steps, [h["env_steps"] for h in history], marker="o", label="environment steps")
    c2 = c.twinx()
    c2.plot(steps, [h["generated_tokens"] for h in history], marker="s", color="tab:red", label="generated tokens")
    c.set_ylabel("environment steps"), c2.set_ylabel("generated tokens", color="tab:red")
    c.set_title("steps and tokens per episode")
    d.plot(steps, [h["workspace_tokens"] for h in history], marker="o")
    d.set_ylabel("tokens"), d.set_title("harness evolution: largest rendered workspace")
    for ax in (a, b, c, d):
        ax.set_xlabel("GRPO step")
    fig.tight_layout()
    return fig


def memory_figure(worker_stats: list[dict]):
    """Matplotlib figure: each collection worker's resident memory (MiB) after every episode, in completion order.

    ``worker_stats``: dicts with ``order`` (episode completion index), ``pid``, ``rss_mb`` and ``peak_rss_mb``, as
    ``evoharness.data.collect.collect`` returns them. Flat lines mean worker recycling keeps TextWorld's leak bounded.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    order = [w["order"] for w in worker_stats]
    ax.plot(order, [w["rss_mb"] for w in worker_stats], ".", markersize=2, label="RSS after the episode")
    ax.plot(order, [w["peak_rss_mb"] for w in worker_stats], "-", linewidth=0.5, alpha=0.6, label="worker peak RSS")
    ax.set_xlabel("episode (completion order)"), ax.set_ylabel("MiB"), ax.legend()
    ax.set_title(f"collection worker memory ({len({w['pid'] for w in worker_stats})} worker processes)")
    fig.tight_layout()
    return fig
