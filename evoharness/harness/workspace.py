"""The BPE workspace (Belief, Progress, Experience), its four meta-actions, and their cost.

- Belief: facts keyed by (entity, attribute), each with the step it came from; a new fact replaces the one it
  supersedes.
- Progress: subgoals (id, text, status, depends_on) forming a DAG; an unknown dependency or a cycle is rejected.
- Experience: lessons in a SQLite store on disk shared across episodes and processes; ``recall`` ranks them with
  BM25+ (Lv & Zhai 2011, via ``rank_bm25.BM25Plus``; plain Okapi IDF turns zero or negative on the tiny
  stores of early training, where a term in half the lessons scores nothing).

Meta-actions are tools (``track``, ``commit``, ``recall``, ``note``) beside the environment tool ``act``. Invalid
arguments give the policy an error result and never raise.
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from evoharness.config import CostConfig

SYSTEM_PROMPT = (
    "You are a household agent in a text world. Each turn, call exactly one tool. `act` runs one environment "
    "command. Your workspace helps you: `track` records facts (Belief), `commit` records subgoals (Progress), "
    "`recall` reads lessons and `note` writes one (Experience). Meta-actions cost reward: use them when they pay."
)

NOTHING = "Nothing happens."


def final_observation(observation: str, won: bool) -> str:
    """The last observation of an episode as the policy sees it (traces and the policy loop agree)."""
    return observation + "\nThe episode is over." + (" You won." if won else "")

META_ACTIONS = ("track", "commit", "recall", "note")
STATUSES = ("pending", "active", "done", "failed")


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS: list[dict] = [
    _fn("act", "Execute one environment command; it must be one of the admissible commands.",
        {"command": {"type": "string", "description": "e.g. 'go to countertop 1'"}}, ["command"]),
    _fn("track", "Belief: record a fact about the environment, replacing the older value.",
        {"entity": {"type": "string"}, "attribute": {"type": "string", "description": "location or state"},
         "value": {"type": "string"}}, ["entity", "attribute", "value"]),
    _fn("commit", "Progress: record a subgoal and its status (pending, active, done, failed).",
        {"id": {"type": "string"}, "status": {"type": "string"}, "text": {"type": "string"},
         "depends_on": {"type": "array", "items": {"type": "string"}}}, ["id", "status"]),
    _fn("recall", "Experience: read the lessons most relevant to a query.",
        {"query": {"type": "string"}}, ["query"]),
    _fn("note", "Experience: write a lesson for later tasks.",
        {"lesson": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}, ["lesson"]),
]


def tokens(text: str) -> list[str]:
    """Whitespace/punctuation word tokens: the unit of the cost model and the render budget."""
    return re.findall(r"[a-z0-9]+", text.lower())


class ExperienceStore:
    """Lessons in SQLite (``path``, or in memory for ``":memory:"``); safe for concurrent writers and openers.

    ``timeout`` (seconds) bounds the wait for a lock held by another process; past it, sqlite3.OperationalError.

    Table ``lessons(id, text, tags, source_episode, uses, successes, count)``; identical text merges (count += 1).
    """

    def __init__(self, path: str | Path = ":memory:", timeout: float = 30.0):
        self.path = str(path)
        self._db = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
        self._create(timeout)

    def _create(self, timeout: float) -> None:
        """Switch to WAL and create the table, retrying while another process does the same.

        Two processes opening a new store at once (the ranks of ``accelerate launch``) race for the lock that the
        journal-mode switch takes; SQLite can answer ``database is locked`` there without waiting on the busy
        timeout, so the set-up is retried with jittered back-off until ``timeout`` seconds have passed.
        """
        mode = "WAL" if self.path != ":memory:" else "MEMORY"
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._db.execute("PRAGMA journal_mode").fetchone()[0].upper() != mode:
                    self._db.execute(f"PRAGMA journal_mode={mode}")
                self._db.execute("CREATE TABLE IF NOT EXISTS lessons (id INTEGER PRIMARY KEY, text TEXT UNIQUE,"
                                 " tags TEXT, source_episode TEXT, uses INTEGER DEFAULT 0,"
                                 " successes INTEGER DEFAULT 0, count INTEGER DEFAULT 1)")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) and "busy" not in str(e):
                    raise
                if time.monotonic() > deadline:
                    raise sqlite3.OperationalError(
                        f"Experience store {self.path}: still locked after {timeout:.0f} s ({e}); another process "
                        "holds it open in a write. Stop that process, or give this run its own experience_path"
                    ) from e
                time.sleep(random.uniform(0.01, 0.1))

    def add(self, text: str, tags: list[str], source_episode: str = "") -> int:
        """Insert a lesson or merge it into an identical one. Returns its id."""
        self._db.execute("INSERT INTO lessons(text, tags, source_episode) VALUES (?, ?, ?) "
                         "ON CONFLICT(text) DO UPDATE SET count = count + 1", (text, json.dumps(tags), source_episode))
        return self._db.execute("SELECT id FROM lessons WHERE text = ?", (text,)).fetchone()[0]

    def all(self) -> list[dict]:
        rows = self._db.execute("SELECT id, text, tags, source_episode, uses, successes, count FROM lessons "
                                "ORDER BY id").fetchall()
        keys = ("id", "text", "tags", "source_episode", "uses", "successes", "count")
        return [dict(zip(keys, r)) | {"tags": json.loads(r[2])} for r in rows]

    def search(self, query: str, k: int) -> list[tuple[dict, float]]:
        """Top-``k`` lessons by BM25 score of ``query`` against lesson text and tags (ties: older first)."""
        from rank_bm25 import BM25Plus

        lessons = self.all()
        if not lessons:
            return []
        corpus = [tokens(lesson["text"] + " " + " ".join(lesson["tags"])) or ["_"] for lesson in lessons]
        scores = BM25Plus(corpus).get_scores(tokens(query))
        ranked = sorted(zip(lessons, scores), key=lambda p: (-p[1], p[0]["id"]))[:k]
        for lesson, _ in ranked:
            self._db.execute("UPDATE lessons SET uses = uses + 1 WHERE id = ?", (lesson["id"],))
        return [(lesson, float(score)) for lesson, score in ranked]

    def record_success(self, lesson_id: int) -> None:
        self._db.execute("UPDATE lessons SET successes = successes + 1 WHERE id = ?", (lesson_id,))

    def copy_to(self, path: str | Path) -> "ExperienceStore":
        """A new store at ``path`` holding the same lessons (SQLite's online backup)."""
        other = ExperienceStore(path)
        self._db.backup(other._db)
        return other


@dataclass
class Fact:
    """A Belief entry: its value, the step it was recorded at and the observation it came from."""

    value: str
    step: int
    source: str = ""


@dataclass
class Subgoal:
    id: str
    text: str
    status: str
    depends_on: list[str]


@dataclass
class EpisodeUsage:
    """Per-episode harness accounting: executed calls by type, their tokens, the policy's generated tokens, and the
    turns the harness rejected (``rejected_turns``: malformed output, unknown tools, invalid or refused meta-actions;
    ``invalid_calls`` counts the meta-actions among them whose arguments failed the schema)."""

    calls: dict[str, int] = field(default_factory=lambda: {m: 0 for m in META_ACTIONS})
    call_tokens_by_type: dict[str, int] = field(default_factory=lambda: {m: 0 for m in META_ACTIONS})
    generated_tokens: int = 0
    invalid_calls: int = 0
    rejected_turns: int = 0

    @property
    def call_tokens(self) -> int:
        return sum(self.call_tokens_by_type.values())

    def cost_by_type(self, cfg: CostConfig) -> dict[str, float]:
        """Per meta-action type: per_call[type] * calls[type] + per_call_token * tokens of those calls and results."""
        return {m: cfg.per_call.get(m, 0.0) * self.calls[m] + cfg.per_call_token * self.call_tokens_by_type[m]
                for m in META_ACTIONS}

    def cost(self, cfg: CostConfig) -> float:
        """cost = sum_type per_call[type] * calls[type] + per_call_token * call_tokens
        + per_generated_token * generated_tokens + per_rejected_turn * rejected_turns (reward units). The reward
        charges it in ``cost.mode: priced``; in ``budget`` mode it is only logged (``evoharness.training.reward``)."""
        return (sum(self.cost_by_type(cfg).values()) + cfg.per_generated_token * self.generated_tokens
                + cfg.per_rejected_turn * self.rejected_turns)


class Workspace:
    """One episode's Belief and Progress over a shared Experience store.

    ``call(name, args, step)`` runs a meta-action and returns ``(result_text, ok)``; it never raises.
    """

    def __init__(self, experience: ExperienceStore, episode_id: str = "", recall_top_k: int = 2,
                 max_belief_facts: int = 12, render_budget_tokens: int = 160):
        self.experience = experience
        self.episode_id = episode_id
        self.recall_top_k = recall_top_k
        self.max_belief_facts = max_belief_facts
        self.render_budget_tokens = render_budget_tokens
        self.belief: dict[tuple[str, str], Fact] = {}
        self.progress: dict[str, Subgoal] = {}
        self.usage = EpisodeUsage()
        self.last_observation = ""
        self.recalled: set[int] = set()

    @classmethod
    def from_config(cls, experience: ExperienceStore, episode_id: str, cfg) -> "Workspace":
        """A workspace with the ``TraceConfig`` settings (recall top-k, Belief facts shown, render budget), so
        traces, rollouts and evaluation see the same harness."""
        return cls(experience, episode_id, cfg.recall_top_k, cfg.max_belief_facts, cfg.render_budget_tokens)

    def observe(self, step: int, observation: str) -> None:
        """Tell the workspace what the environment just said (Belief facts cite it as their source)."""
        self.last_observation = observation

    def finish(self, won: bool) -> None:
        """End of episode: lessons recalled in it count a use that ended in success when ``won``."""
        if won:
            for lesson_id in self.recalled:
                self.experience.record_success(lesson_id)

    # --- meta-actions ---------------------------------------------------------------------------------
    def call(self, name: str, args: dict, step: int = 0) -> tuple[str, bool]:
        """Execute meta-action ``name`` with ``args``. Returns (result text for the policy, whether it was valid)."""
        handler = {"track": self._track, "commit": self._commit, "recall": self._recall, "note": self._note}.get(name)
        if handler is None:
            return f"error: unknown meta-action {name!r}; use one of {list(META_ACTIONS)}", False
        if not isinstance(args, dict):
            self.usage.invalid_calls += 1
            return f"error: {name} arguments must be a JSON object", False
        try:
            result = handler(args, step)
        except (KeyError, TypeError, ValueError) as exc:
            self.usage.invalid_calls += 1
            msg = exc.args[0] if exc.args else str(exc)
            return f"error: {name}: {msg}", False
        self.usage.calls[name] += 1
        self.usage.call_tokens_by_type[name] += len(tokens(json.dumps(args))) + len(tokens(result))
        return result, True

    def _track(self, args: dict, step: int) -> str:
        entity, attribute, value = (_req_str(args, k) for k in ("entity", "attribute", "value"))
        self.belief[(entity, attribute)] = Fact(value, step, self.last_observation)
        return f"ok: {entity} {attribute} = {value}"

    def _commit(self, args: dict, step: int) -> str:
        sid, status = _req_str(args, "id"), _req_str(args, "status")
        if status not in STATUSES:
            raise ValueError(f"status {status!r} must be one of {list(STATUSES)}")
        deps = args.get("depends_on") or []
        if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
            raise ValueError("depends_on must be a list of subgoal ids")
        unknown = [d for d in deps if d not in self.progress and d != sid]
        if unknown:
            raise ValueError(f"unknown dependency {unknown}; commit those subgoals first")
        old = self.progress.get(sid)
        text = str(args.get("text") or (old.text if old else sid))
        candidate = dict(self.progress)
        candidate[sid] = Subgoal(sid, text, status, list(deps) if deps or old is None else old.depends_on)
        if _has_cycle(candidate):
            raise ValueError(f"depends_on {deps} would make a cycle through {sid!r}")
        self.progress = candidate
        return f"ok: {sid} {status}"

    def _recall(self, args: dict, step: int) -> str:
        hits = self.experience.search(_req_str(args, "query"), self.recall_top_k)
        self.recalled.update(lesson["id"] for lesson, _ in hits)
        if not hits:
            return "no lessons yet"
        return "\n".join(f"[{score:.1f}] {lesson['text']}" for lesson, score in hits)

    def _note(self, args: dict, step: int) -> str:
        lesson = _req_str(args, "lesson")
        tags = args.get("tags") or []
        if not isinstance(tags, list):
            raise ValueError("tags must be a list of strings")
        lid = self.experience.add(lesson, [str(t) for t in tags], self.episode_id)
        return f"ok: lesson {lid} saved"

    # --- rendering ------------------------------------------------------------------------------------
    def render(self) -> str:
        """The workspace as a compact text block within ``render_budget_tokens`` word tokens.

        Compaction: done subgoals collapse to their ids, only the newest ``max_belief_facts`` facts are kept,
        and lines are dropped from the end once the budget is reached.
        """
        done = [g for g in self.progress.values() if g.status == "done"]
        open_goals = [g for g in self.progress.values() if g.status != "done"]
        lines = []
        if self.progress:
            lines.append("Progress: done " + (", ".join(g.id for g in done) or "none")
                         + "".join(f"; {g.id} {g.status}: {g.text}" for g in open_goals))
        facts = sorted(self.belief.items(), key=lambda kv: -kv[1].step)[: self.max_belief_facts]
        if facts:
            lines.append("Belief: " + "; ".join(f"{e} {a}={f.value}" for (e, a), f in facts))
        out, used = [], 0
        for line in lines:
            kept = []
            for word in line.split():
                n = len(tokens(word))
                if used + n > self.render_budget_tokens:
                    break
                kept.append(word)
                used += n
            if kept:
                out.append(" ".join(kept))
            if len(kept) < len(line.split()):
                break
        return "\n".join(out)


def _req_str(args: dict, key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"argument {key!r} must be a non-empty string")
    return value.strip()


def _has_cycle(goals: dict[str, Subgoal]) -> bool:
    state: dict[str, int] = {}

    def visit(node: str) -> bool:
        if state.get(node) == 1:
            return True
        if state.get(node) == 2 or node not in goals:
            return False
        state[node] = 1
        if any(visit(d) for d in goals[node].depends_on):
            return True
        state[node] = 2
        return False

    return any(visit(g) for g in goals)
