"""Environment adapters behind one protocol, so the harness is a state layer over existing environments.

The protocol (``TextEnv``): ``reset(seed) -> StepResult``, ``step(action) -> StepResult``, ``close()``, and the
attributes ``game``, ``task_type`` and ``task``. ``StepResult`` carries observation, reward, done, won,
admissible commands and (where an expert exists) the expert's next action. Implementations:
- ``evoharness.env.alfworld.ALFWorldEnv``: ALFWorld TextWorld games;
- ``ReplayEnv``: steps through a raw-log episode (trace construction, tests);
- ``GymTextEnv``: any gymnasium-style text environment (``reset() -> (obs, info)``, ``step(a) -> (obs, reward,
  terminated, truncated, info)``; the older 4-tuple ``(obs, reward, done, info)`` is accepted too).
"""

from __future__ import annotations

from typing import Protocol

from evoharness.data.records import Episode, task_of
from evoharness.env.alfworld import StepResult


class TextEnv(Protocol):
    game: str
    task_type: str
    task: str

    def reset(self, seed: int = 0) -> StepResult: ...

    def step(self, action: str) -> StepResult: ...

    def close(self) -> None: ...


class ReplayEnv:
    """Replays a logged episode: each ``step`` returns the next logged observation.

    ``expert_action`` is the logged action, so ``ExpertPolicy`` replays the episode exactly. Raises ValueError when
    ``step`` is given another action than the log's (``strict``), or is called past the end of the episode.
    """

    def __init__(self, episode: Episode, strict: bool = True):
        self.episode, self.strict = episode, strict
        self.game, self.task_type = episode.game, episode.task_type
        self.task = task_of(episode.records[0]["observation"])
        self._t = 0

    def _result(self) -> StepResult:
        rec = self.episode.records[self._t]
        nxt = self.episode.records[self._t + 1]["action"] if self._t + 1 < len(self.episode.records) else None
        return StepResult(rec["observation"], float(rec["reward"]), bool(rec["done"]), bool(rec["won"]),
                          list(rec["admissible_commands"]), nxt)

    def reset(self, seed: int = 0) -> StepResult:
        self._t = 0
        return self._result()

    def step(self, action: str) -> StepResult:
        if self._t + 1 >= len(self.episode.records):
            raise ValueError(f"episode {self.episode.episode_id} has only {len(self.episode.records) - 1} steps")
        expected = self.episode.records[self._t + 1]["action"]
        if self.strict and action != expected:
            raise ValueError(f"episode {self.episode.episode_id} step {self._t + 1}: the log took {expected!r}, "
                             f"not {action!r}")
        self._t += 1
        return self._result()

    def close(self) -> None:
        pass


class GymTextEnv:
    """Wraps a gymnasium-style text environment.

    Args:
        env: the environment; observations are text (or a dict/list whose text ``obs_key`` picks).
        game, task_type: labels for reports.
        admissible_key / won_key: where ``info`` holds the admissible commands and the success flag. Without
            admissible commands, any text is accepted (``admissible_commands`` is empty and the policy loop passes
            the command through unchanged).
    """

    def __init__(self, env, game: str = "gym", task_type: str = "", admissible_key: str = "admissible_commands",
                 won_key: str = "won"):
        self.env, self.game, self.task_type = env, game, task_type
        self.admissible_key, self.won_key = admissible_key, won_key
        self.task = ""

    def _info(self, info) -> tuple[list[str], bool]:
        info = info or {}
        admissible = info.get(self.admissible_key) or []
        won = info.get(self.won_key, False)
        return list(admissible), bool(won)

    def reset(self, seed: int = 0) -> StepResult:
        out = self.env.reset(seed=seed) if _accepts_seed(self.env.reset) else self.env.reset()
        obs, info = out if isinstance(out, tuple) else (out, {})
        admissible, won = self._info(info)
        self.task = task_of(str(obs))
        return StepResult(str(obs), 0.0, False, won, admissible, None)

    def step(self, action: str) -> StepResult:
        out = self.env.step(action)
        if len(out) == 5:
            obs, reward, terminated, truncated, info = out
            done = bool(terminated or truncated)
        else:
            obs, reward, done, info = out
        admissible, won = self._info(info)
        return StepResult(str(obs), float(reward or 0.0), bool(done), won, admissible, None)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close:
            close()


def _accepts_seed(fn) -> bool:
    import inspect

    try:
        return "seed" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
