import json

import pytest

from evoharness.config import CostConfig
from evoharness.data.rawlog import parse_lines
from evoharness.env.adapters import GymTextEnv, ReplayEnv
from evoharness.env.alfworld import games_root, list_games
from evoharness.harness.workspace import ExperienceStore, Workspace
from evoharness.policy.agent import Decision, ExpertPolicy, run_episode


def test_replay_env_reproduces_a_logged_episode(tiny_logs):
    out, _ = tiny_logs
    eps = parse_lines((out / "logs" / "shard-00000.jsonl").read_text().splitlines(), "shard")
    ep = eps[0]
    res = run_episode(ReplayEnv(ep), ExpertPolicy(), Workspace(ExperienceStore()), CostConfig(), max_env_steps=100)
    assert res.won == ep.won and res.env_steps == len(ep.records) - 1
    assert [t["command"] for t in res.transcript if t["turn"] == "act"] == [r["action"] for r in ep.records[1:]]
    env = ReplayEnv(ep)
    env.reset()
    with pytest.raises(ValueError, match="the log took"):
        env.step("jump")


class Walkthrough:
    def __init__(self, commands):
        self.commands = list(commands)

    def start(self, messages, tools):
        pass

    def decide(self, state):
        return Decision("act", {"command": self.commands.pop(0) if self.commands else "look"})

    def observe(self, text):
        pass


def test_gym_style_text_env_runs_through_the_harness():
    """TextWorld's own gym interface (old 4-tuple step API) on a real ALFWorld game, played from its walkthrough."""
    import textworld
    import textworld.gym
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler

    game = list_games("valid_seen", limit=1, offset=3)[0]
    path = games_root() / game
    walkthrough = json.loads(path.read_text())["walkthrough"]
    infos = textworld.EnvInfos(won=True, admissible_commands=True)
    env_id = textworld.gym.register_game(str(path), infos, max_episode_steps=50, wrappers=[AlfredDemangler()])
    env = GymTextEnv(textworld.gym.make(env_id), game=game)
    res = run_episode(env, Walkthrough(walkthrough), Workspace(ExperienceStore()), CostConfig(), max_env_steps=50)
    env.close()
    assert res.won and res.env_steps == len(walkthrough) and res.remapped == 0


def test_expert_through_the_loop_matches_the_collected_expert(tiny_logs, tiny_games):
    """The handcoded expert played through the harness loop wins exactly the games it won in collection
    (unperturbed episodes)."""
    from evoharness.env.alfworld import ALFWorldEnv

    out, _ = tiny_logs
    eps = {e.game: e for e in parse_lines((out / "logs" / "shard-00000.jsonl").read_text().splitlines(), "s")}
    unperturbed = [g for g in tiny_games if not eps[g].records[0]["perturbed"]]
    assert unperturbed, "every collected episode was perturbed: nothing to compare (collection settings changed?)"
    for game in unperturbed:
        env = ALFWorldEnv(game, max_steps=51)
        res = run_episode(env, ExpertPolicy(), Workspace(ExperienceStore()), CostConfig(), max_env_steps=50)
        env.close()
        assert res.won == eps[game].won
