"""Paired comparison of two policies evaluated on the same games."""

from __future__ import annotations


def mcnemar_exact(a: dict[str, bool], b: dict[str, bool]) -> dict:
    """Counts over the games in both ``{game: won}`` maps and the exact two-sided McNemar p-value: a two-sided
    binomial test of the games won by one policy only against p = 0.5 (McNemar 1947; ``scipy.stats.binomtest``).

    Returns ``games``, ``won_a``, ``won_b``, ``both``, ``neither``, ``only_a``, ``only_b`` and ``p`` (1.0 when no
    game is won by one only). Raises ValueError when the two share no game."""
    from scipy.stats import binomtest

    games = sorted(set(a) & set(b))
    if not games:
        raise ValueError("the two evaluations share no game: were they run on the same split?")
    only_a = sum(a[g] and not b[g] for g in games)
    only_b = sum(b[g] and not a[g] for g in games)
    n = only_a + only_b
    return {"games": len(games), "won_a": sum(a[g] for g in games), "won_b": sum(b[g] for g in games),
            "both": sum(a[g] and b[g] for g in games), "neither": sum(not a[g] and not b[g] for g in games),
            "only_a": only_a, "only_b": only_b,
            "p": binomtest(only_a, n, 0.5, alternative="two-sided").pvalue if n else 1.0}
