"""What the policy reads each turn in ``turn`` context mode: a fresh, compact prompt instead of the whole episode.

Two context modes (``TraceConfig.context``):

- ``history``: one growing conversation per episode (system + tools + every tool call and tool response), the
  layout GRPO's multi-turn ``rollout_func`` trains on token for token.
- ``turn``: each turn is its own prompt, built by ``TurnView.prompt`` from the task, the rendered BPE workspace
  (with ``harness``), the lessons the last ``recall`` returned, the last few commands, and the latest
  observation. The policy keeps what it needs across turns only through its workspace: Belief, Progress and
  Experience are its memory, which is the EvoHarness premise. A small model trained from scratch plays far better
  this way (``../shared/FIELD-NOTES.md``: a compact per-step summary took a 3.46M-parameter model from 12 % to 58 %
  on ``valid_seen``), and the prompt length stays bounded however long the episode runs.

The same ``TurnView`` builds the SFT examples (``evoharness.harness.traces``) and the prompts at run time
(``evoharness.policy.agent.run_episode``), so training and acting see byte-identical text.
"""

from __future__ import annotations

from evoharness.data.records import TASK_MARKER, task_of
from evoharness.harness.workspace import NOTHING

TURN_SYSTEM_PROMPT = (
    "You are a household agent in a text world. Call one tool per turn: act runs an environment command; "
    "track, commit, recall and note update your workspace and cost reward."
)
PLAIN_SYSTEM_PROMPT = "You are a household agent in a text world. Call act with one environment command per turn."


class TurnView:
    """The per-turn prompt of one episode (see module docstring).

    Args:
        task: the task text ("put a clean soapbar in drawer"); empty: read from the first observation's
            "Your task is to: ..." line (as ``rawlog.Episode.task`` does).
        harness: show the workspace and the recalled lessons (False: the plain observation/action baseline).
        recent_actions: how many of the last environment commands are listed (oldest first).
        system_prompt: include a short system message (off for the tiny embedded model: it is the same every turn).
        lesson_turns: on the prompts of how many environment steps a ``recall``'s lessons are shown: 0 keeps them for
            the rest of the episode; 1 shows them until the first command issued after a prompt showed them. With
            parallel calls the teacher's first recall runs beside the first command, so its lessons are read on the
            second turn; with one call per turn, on the turn right after the recall.
    """

    def __init__(self, task: str = "", harness: bool = True, recent_actions: int = 8, system_prompt: bool = False,
                 lesson_turns: int = 0):
        if lesson_turns < 0:
            raise ValueError(f"lesson_turns is {lesson_turns}; use 0 (rest of the episode) or a number of commands")
        self.task = task
        self.harness = harness
        self.recent_actions = recent_actions
        self.system_prompt = system_prompt
        self.lesson_turns = lesson_turns
        self.actions: list[str] = []
        self.observation = ""
        self.lessons: str | None = None
        self.lessons_left = 0  # commands left before the lessons are hidden (lesson_turns > 0)
        self.lessons_shown = False  # a prompt has shown the current lessons: only then do commands count down
        self.last_call: str | None = None

    def start(self, observation: str) -> None:
        """The episode's first observation (the room and the task)."""
        self.observation = observation
        if not self.task and TASK_MARKER in observation:
            self.task = task_of(observation)

    def record_act(self, command: str, observation: str) -> None:
        """An executed environment command and what the environment answered."""
        self.actions.append(command + (" (nothing happened)" if observation.strip() == NOTHING else ""))
        self.observation = observation
        self.last_call = None
        if self.lesson_turns and self.lessons is not None and self.lessons_shown:
            self.lessons_left -= 1
            if self.lessons_left <= 0:
                self.lessons = None

    def record_meta(self, name: str, result: str, ok: bool) -> None:
        """A meta-action call and its result (or error), shown as the ``Last call:`` line until the next command;
        ``recall``'s lessons stay shown for ``lesson_turns`` commands (Belief and Progress show in the render)."""
        if name == "recall" and ok:
            self.lessons, self.lessons_left, self.lessons_shown = result, self.lesson_turns, False
        self.last_call = f"{name} -> {result.splitlines()[0] if result else ''}" if name != "recall" or not ok \
            else "recall -> lessons above"

    def record_error(self, text: str) -> None:
        """A turn that was neither a command nor a meta-action (e.g. an unknown tool): its error is the last call."""
        self.last_call = text

    def user_text(self, workspace_render: str) -> str:
        """The user message of this turn. ``workspace_render``: ``Workspace.render()`` (ignored without harness)."""
        lines = [f"Task: {self.task}"]
        if self.harness:
            lines.append(workspace_render or "Workspace: empty")
            if self.lessons is not None:
                lines.append("Lessons: " + self.lessons.replace("\n", " | "))
                self.lessons_shown = True
        recent = self.actions[-self.recent_actions:] if self.recent_actions > 0 else []
        if recent:
            lines.append("Recent: " + " | ".join(recent))
        lines.append(f"Observation: {self.observation}")
        if self.last_call is not None:
            lines.append(f"Last call: {self.last_call}")
        return "\n".join(lines)

    def prompt(self, workspace_render: str = "") -> list[dict]:
        """The chat messages of this turn: ``[system?, user]``, ready for ``apply_chat_template``."""
        msgs = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": TURN_SYSTEM_PROMPT if self.harness else PLAIN_SYSTEM_PROMPT})
        msgs.append({"role": "user", "content": self.user_text(workspace_render)})
        return msgs


def turn_view(cfg) -> TurnView | None:
    """A fresh ``TurnView`` for an episode under ``TraceConfig`` ``cfg``; None in the ``history`` context."""
    if cfg.context != "turn":
        return None
    return TurnView("", cfg.harness, cfg.recent_actions, cfg.system_prompt, cfg.lesson_turns)


LAYOUT_FIELDS = ("context", "harness", "recent_actions", "system_prompt", "tools_in_prompt", "recall_top_k",
                 "max_belief_facts", "render_budget_tokens", "parallel_calls", "lesson_turns")


def layout_of(cfg) -> dict:
    """The ``TraceConfig`` fields that decide what a trained policy reads each turn. SFT stores them in the model's
    ``config.json`` (attribute ``evoharness_layout``), so a model found later by path or registry URI is prompted
    the way it was trained."""
    return {k: getattr(cfg, k) for k in LAYOUT_FIELDS}


def with_layout(cfg, model_config):
    """``cfg`` (a ``TraceConfig``) with the layout a model was trained on, when its config records one."""
    import dataclasses

    layout = getattr(model_config, "evoharness_layout", None)
    if not isinstance(layout, dict):
        return cfg
    return dataclasses.replace(cfg, **{k: v for k, v in layout.items() if k in LAYOUT_FIELDS})
