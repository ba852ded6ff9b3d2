"""Figures logged as MLflow artifacts."""

from __future__ import annotations


def annealing_figure(history: list[dict]):
    """Matplotlib figure: success, reward, cost and meta-actions per episode by type over GRPO steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    for key in ("success_rate", "reward", "cost"):
        a.plot(steps, [h[key] for h in history], marker="o", label=key)
    a.set_xlabel("GRPO step"), a.legend(), a.set_title("success, reward, cost")
    for m in ("track", "commit", "recall", "note"):
        b.plot(steps, [h[f"meta_actions_{m}"] for h in history], marker="o", label=m)
    b.set_xlabel("GRPO step"), b.set_ylabel("per episode"), b.legend(), b.set_title("harness annealing")
    fig.tight_layout()
    return fig
