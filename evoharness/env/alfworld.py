"""ALFWorld (TextWorld) environment adapter: games by split, task parameters, the handcoded expert.

Games come from ``$ALFWORLD_DATA/json_2.1.1/<split>/<task>-<Object>-<MovableRecep>-<Recep>-<scene>/<trial>/``.
The folders shipped here hold only ``game.tw-pddl``; ALFWorld's handcoded expert
(``alfworld.agents.expert.HandCodedTWAgent``) normally reads its task parameters from a ``traj_data.json``
beside the game, so ``task_params_from_path`` rebuilds them from the folder name instead (see
``../shared/alfworld/README.md``). Success is ``infos["won"]``, never ``done``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import io
import os
import random
from dataclasses import dataclass
from pathlib import Path

from evoharness.data.records import task_of
from evoharness.env import textworld_speedups

TASK_TYPES = {
    "pick_and_place_simple": "Pick",
    "pick_clean_then_place_in_recep": "Clean",
    "pick_heat_then_place_in_recep": "Heat",
    "pick_cool_then_place_in_recep": "Cool",
    "look_at_obj_in_light": "Look",
    "pick_two_obj_and_place": "Pick Two",
}


def default_data_dir() -> Path:
    """Where the ALFWorld games live: ``$ALFWORLD_DATA`` or ALFWorld's own default, ``~/.cache/alfworld``.

    (Importing ``alfworld`` sets ``ALFWORLD_DATA`` to that default when it is unset, so both agree.)"""
    return Path(os.environ.get("ALFWORLD_DATA") or Path.home() / ".cache" / "alfworld").expanduser()


def games_root(data_dir: str | Path | None = None) -> Path:
    """The ``json_2.1.1`` folder. Raises FileNotFoundError with the command that unpacks the games."""
    root = Path(data_dir or default_data_dir()) / "json_2.1.1"
    if not root.is_dir():
        raise FileNotFoundError(
            f"ALFWorld games not found at {root}. Unpack them with `make data` "
            f"(xz -dc ../shared/alfworld/json_2.1.1_tw-pddl.tar.xz | tar -x -C {root.parent}) or set ALFWORLD_DATA."
        )
    return root


def list_games(split: str, limit: int = 0, offset: int = 0, stride: int = 1,
               data_dir: str | Path | None = None) -> list[str]:
    """Game paths of a split, relative to ``json_2.1.1`` (e.g. ``train/<task>/<trial>/game.tw-pddl``), sorted.

    Any split name works (``train``, ``valid_seen``, ``valid_unseen``, ...). ``offset``/``stride``/``limit`` select
    ``sorted[offset::stride][:limit]`` (limit 0 = all).
    Raises FileNotFoundError naming the split and the splits present.
    """
    root = games_root(data_dir)
    split_dir = root / split
    if not split_dir.is_dir():
        present = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise FileNotFoundError(f"split {split!r} not found under {root}; present: {present}")
    games = sorted(str(p.relative_to(root)) for p in split_dir.glob("*/*/game.tw-pddl"))
    games = games[offset::stride]
    return games[:limit] if limit else games


def task_type_of(game: str) -> str:
    """ALFWorld task type from a game path, e.g. ``pick_two_obj_and_place``."""
    return Path(game).parent.parent.name.split("-")[0]


def task_params_from_path(game: str) -> dict:
    """The handcoded expert's ``pddl_params`` plus ``task_type``, rebuilt from the game's folder name.

    ``<task>-<Object>-<MovableRecep>-<Recep>-<scene>``: ``object_target=<Object>``, ``mrecep_target`` ('' for None),
    ``parent_target=<Recep>`` except for ``look_at_obj_in_light`` where ``<Recep>`` is the ``toggle_target``.
    Raises ValueError for a folder name of another shape.
    """
    name = Path(game).parent.parent.name
    parts = name.split("-")
    if len(parts) != 5 or parts[0] not in TASK_TYPES:
        raise ValueError(f"{game}: folder {name!r} is not <task>-<Object>-<MovableRecep>-<Recep>-<scene>")
    task_type, obj, mrecep, recep, _scene = parts
    params = {
        "task_type": task_type,
        "object_target": obj,
        "mrecep_target": "" if mrecep == "None" else mrecep,
        "parent_target": recep,
        "toggle_target": "",
        "object_sliced": False,
    }
    if task_type == "look_at_obj_in_light":
        params["parent_target"], params["toggle_target"] = "", recep
    return params


EXPERT = f"alfworld-{importlib.metadata.version('alfworld')}-handcoded+move-tracking"
"""The expert that labels collected logs: the installed ALFWorld's handcoded TextWorld expert (0.4.2, pinned) with
``move`` commands tracked (``_tracking_moves``, from 2026-12-02). Collection manifests (``settings.expert``), DAgger
settings and evaluations of ``--policy expert`` record it; logs without it were made by the expert before that fix.
Change the suffix whenever ``_tracking_moves`` changes: the label keys resumable folders and names data versions."""


EXPERT_HASH_SEED = "0"


@contextlib.contextmanager
def pinned_hash_seed(seed: str = EXPERT_HASH_SEED):
    """Set ``PYTHONHASHSEED`` to ``seed`` for the processes started inside (a spawned interpreter reads it when it
    starts; this process's own hashing does not change), and restore it after. ALFWorld's handcoded expert breaks
    ties between equal objects by set order, which depends on the string hash seed (``evoharness.data.collect``), so
    processes that play the expert side by side must share it to make the same choices."""
    before = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = seed
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = before


def import_environment() -> None:
    """Import TextWorld and ALFWorld (the modules an episode loads), e.g. as a worker pool's initializer, before
    any episode's alarm (``evoharness.data.collect``'s per-episode ``setitimer``) is set. An alarm that fired during
    their first import left ``textworld`` half-initialized, and every later episode in that worker failed at once
    (``partially initialized module 'textworld'``; seen in collection, 2026-12-02)."""
    import textworld.gym  # noqa: F401
    from alfworld.agents.environment import alfred_tw_env  # noqa: F401
    from alfworld.agents.expert import handcoded_expert_tw  # noqa: F401


@functools.cache
def _tracking_moves(policy_cls: type) -> type:
    """A subclass of ``policy_cls`` (an ALFWorld handcoded-expert task policy) whose state tracking sees ``move``
    commands; it keeps the class name and is made once per class.

    ALFWorld 0.4 renamed ``put X in/on Y`` to ``move X to Y`` (alfworld/alfworld#94), but
    ``BasePolicy.update_state_tracking`` (``alfworld/agents/expert/handcoded_expert.py``, 0.4.2) still looks for
    ``"put"`` in the last command. After a ``move`` the expert believes it still holds the object. In Pick Two it then
    answers ``move <the object already placed> to <receptacle>`` while holding the second one: inadmissible, so
    ``AlfredExpert`` plans ``look`` and the episode usually wanders to the step limit (measured: 167 of 813 Pick Two
    episodes won in ``data-full``, against 2,591 of 2,740 for the other task types). The same happens after it puts
    back an object it should not hold. Tracking a successful ``move`` (the base method skips "Nothing happens") as
    the ``put`` it replaced fixes both. No ALFWorld object or receptacle name holds ``open``, ``close`` or ``take``,
    the substrings checked before ``put``. Upstream, the open pull request alfworld/alfworld#114 reports wrong state
    updates in this expert.
    """

    class Policy(policy_cls):
        def update_state_tracking(self, game_state, last_action):
            if last_action.startswith("move ") and self.inventory:
                last_action = "put " + last_action.removeprefix("move ")
            return super().update_state_tracking(game_state, last_action)

    Policy.__name__ = Policy.__qualname__ = policy_cls.__name__
    return Policy


def _expert_module():
    """ALFWorld's handcoded expert module: its policies call the module-level name ``random``."""
    from alfworld.agents.expert import handcoded_expert

    return handcoded_expert


def _expert_wrapper():
    """ALFWorld's ``AlfredExpert`` wrapper with a handcoded agent that takes its task from the folder name and
    tracks ``move`` commands (``_tracking_moves``)."""
    from alfworld.agents.environment.alfred_tw_env import AlfredExpert
    from alfworld.agents.expert import handcoded_expert as he
    from alfworld.agents.expert.handcoded_expert_tw import HandCodedTWAgent

    class FolderTaskAgent(HandCodedTWAgent):
        def reset(self, game="INVALID"):
            params = task_params_from_path(game)
            self.task_params = {k: (v.lower() if v in he.constants.OBJECTS else v) for k, v in params.items()}
            policy_cls = _tracking_moves(self.get_task_policy(self.task_params))
            self.policy = policy_cls(self.task_params, max_steps=self.max_steps)

    class FolderTaskExpert(AlfredExpert):
        def load(self, gamefile):
            super().load(gamefile)
            self._handcoded_expert = FolderTaskAgent(max_steps=200)

    return FolderTaskExpert


def _quiet():
    """TextWorld's PDDL loader prints a warning line per duplicated atom; keep them out of the logs."""
    return contextlib.redirect_stdout(io.StringIO())


@dataclass
class StepResult:
    """What one environment step returns: observation text, reward, done, won, admissible commands."""

    observation: str
    reward: float
    done: bool
    won: bool
    admissible_commands: list[str]
    expert_action: str | None


class ALFWorldEnv:
    """One ALFWorld game behind the adapter protocol: ``reset() -> StepResult``, ``step(action) -> StepResult``.

    Args:
        game: game path relative to ``json_2.1.1`` (or absolute).
        max_steps: TextWorld's episode step limit (``done`` becomes true there, ``won`` stays false).
        expert: also compute the handcoded expert's next action (``StepResult.expert_action``).
        data_dir: folder holding ``json_2.1.1``.

    Plays TextWorld with ``evoharness.env.textworld_speedups`` installed (the same episodes, about twice as fast;
    ``EVOHARNESS_TEXTWORLD_SPEEDUPS=0`` plays it as shipped).
    """

    def __init__(self, game: str, max_steps: int = 50, expert: bool = True, data_dir: str | Path | None = None):
        import textworld
        import textworld.gym
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredExpertType, AlfredInfos

        textworld_speedups.install()
        path = Path(game) if Path(game).is_absolute() else games_root(data_dir) / game
        if not path.is_file():
            raise FileNotFoundError(f"ALFWorld game file missing: {path}")
        self.game = game
        self.task_type = task_type_of(game)
        extras = ["gamefile"] + (["expert_plan"] if expert else [])
        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=extras)
        wrappers = [AlfredDemangler(shuffle=False), AlfredInfos]
        if expert:
            wrappers.append(_expert_wrapper()(expert_type=AlfredExpertType.HANDCODED))
        env_id = textworld.gym.register_game(str(path), infos, max_episode_steps=max_steps, wrappers=wrappers)
        with _quiet():
            self._env = textworld.gym.make(env_id)
        self.task = ""

    def _result(self, obs, reward, done, info) -> StepResult:
        plan = info.get("extra.expert_plan") or [None]
        return StepResult(obs, float(reward), bool(done), bool(info["won"]),
                          list(info["admissible_commands"]), plan[0])

    def reset(self, seed: int = 0) -> StepResult:
        """Start the episode. The handcoded expert breaks ties with ``random.choice``; it draws from its own
        ``random.Random(seed)`` (the same sequence ``random.seed(seed)`` gives), so a thread of the same process that
        uses the global generator (a logging or HTTP client's jitter) cannot change an expert episode."""
        _expert_module().random = random.Random(seed)
        with _quiet():
            obs, info = self._env.reset()
        self.task = task_of(obs)
        return self._result(obs, 0.0, False, info)

    def step(self, action: str) -> StepResult:
        """Execute one text command (ALFWorld 0.4 syntax, e.g. ``move apple 1 to countertop 2``)."""
        with _quiet():
            obs, reward, done, info = self._env.step(action)
        return self._result(obs, reward, done, info)

    def close(self) -> None:
        self._env.close()
