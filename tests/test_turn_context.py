"""The turn context (issue 5): per-turn SFT examples, the plain baseline, SFT on them, and admissible decoding."""

import dataclasses
import json

import pytest

from evoharness.config import CostConfig, SFTStageConfig, TraceConfig
from evoharness.data.rawlog import Episode, parse_lines
from evoharness.env.alfworld import ALFWorldEnv, list_games
from evoharness.harness.context import TurnView, layout_of, turn_view
from evoharness.harness.traces import Teacher, build_traces
from evoharness.harness.workspace import ExperienceStore, Workspace
from evoharness.policy.agent import run_episode
from evoharness.policy.lm_policy import ACT_PREFIX, COMMAND_CLOSE, EMPTY_THINK, ENTITY_CLOSE, ENTITY_OPEN, LMPolicy
from evoharness.training.launch import accelerate_launch
from evoharness.training.model import build_default_model, load_policy
from tests.test_training import TINY_MODEL
from tests.test_workspace_states import episode

TURN = TraceConfig(context="turn")


def _calls(rows):
    return [(r["completion"][0]["tool_calls"][0]["function"]["name"],
             json.loads(r["completion"][0]["tool_calls"][0]["function"]["arguments"])) for r in rows]


def test_turn_examples_show_the_workspace_the_teacher_built():
    row = Teacher(TURN).annotate(episode())
    turns = row["turns"]
    names = [n for n, _ in _calls(turns)]
    # every policy turn of the history trace is an example (no label is dropped in this all-expert episode)
    assert names == [m["tool_calls"][0]["function"]["name"] for m in row["messages"] if m["role"] == "assistant"]
    first, take = turns[0]["prompt"], turns[names.index("act", 5)]["prompt"]
    assert first == [{"role": "user", "content": "Task: put a hot mug in cabinet.\nWorkspace: empty\nObservation: "
                      + episode().records[0]["observation"]}]
    # the turn after "open cabinet 4" revealed the mug and the teacher tracked it and committed "find"
    assert take[-1]["content"] == (
        "Task: put a hot mug in cabinet.\n"
        "Progress: done find\n"
        "Belief: mug 1 location=cabinet 4\n"
        "Lessons: no lessons yet\n"
        "Recent: go to cabinet 4 | put mug 1 in cabinet 4 (nothing happened) | open cabinet 4\n"
        "Observation: You open the cabinet 4. The cabinet 4 is open. In it, you see a mug 1.\n"
        "Last call: commit -> ok: find done")
    assert _calls(turns)[names.index("act", 5)] == ("act", {"command": "take mug 1 from cabinet 4"})
    assert _calls(turns)[0] == ("recall", {"query": "mug"})  # short arguments: the task is never copied


def test_perturbed_and_look_labels_are_history_not_targets():
    ep = episode()
    ep.records[2]["action_source"] = "invalid"  # "put mug 1 in cabinet 4"
    ep.records[1]["action"], ep.records[1]["observation"] = "look", ep.records[1]["observation"]
    turns = Teacher(TURN).annotate(ep)["turns"]
    commands = [a["command"] for n, a in _calls(turns) if n == "act"]
    assert "look" not in commands and "put mug 1 in cabinet 4" not in commands
    assert commands[0] == "open cabinet 4"
    # ... but both stay in the history the next prompt shows
    nxt = next(t for t, (n, a) in zip(turns, _calls(turns)) if a.get("command") == "open cabinet 4")
    assert "Recent: look | put mug 1 in cabinet 4 (nothing happened)" in nxt["prompt"][-1]["content"]


def test_plain_baseline_has_no_meta_actions_and_no_workspace(tmp_path):
    plain = dataclasses.replace(TURN, harness=False)
    stats = build_traces([episode()], dataclasses.replace(plain, valid_share=0.0), tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert {n for n, _ in _calls(rows)} == {"act"} and len(rows) == stats["steps"] == 9
    assert all("Progress" not in r["prompt"][-1]["content"] and "Lessons" not in r["prompt"][-1]["content"]
               for r in rows)
    with pytest.raises(ValueError, match="needs traces.context: turn"):
        TraceConfig(harness=False)


def test_generic_episode_gets_task_level_meta_actions():
    recs = [{"game": "generic/ep1", "task_type": "generic", "episode_id": "ep1", "step": 0,
             "observation": "A shell.\n\nYour task is to: list files", "admissible_commands": [], "action": None,
             "action_source": None, "reward": 0.0, "done": False, "won": False, "perturbed": False},
            {"game": "generic/ep1", "task_type": "generic", "episode_id": "ep1", "step": 1,
             "observation": "a.txt b.txt", "admissible_commands": [], "action": "ls", "action_source": "agent",
             "reward": 1.0, "done": True, "won": True, "perturbed": False}]
    row = Teacher(TURN).annotate(Episode("ep1", "generic/ep1", "generic", recs))
    assert [n for n, _ in _calls(row["turns"])] == ["recall", "commit", "act", "note"]
    assert row["meta_actions"] == {"track": 0, "commit": 1, "recall": 1, "note": 1}
    assert _calls(row["turns"])[-1][1]["lesson"] == "list files: won in 1 steps"


@pytest.fixture(scope="module")
def turn_traces(tmp_path_factory, tiny_logs):
    out, _ = tiny_logs
    eps = parse_lines((out / "logs" / "shard-00000.jsonl").read_text().splitlines(), "shard")
    d = tmp_path_factory.mktemp("turn_traces")
    build_traces(eps, dataclasses.replace(TURN, valid_share=0.0), d)
    return d


@pytest.fixture(scope="module")
def turn_model(tmp_path_factory, turn_traces):
    return build_default_model(TINY_MODEL, turn_traces / "train.jsonl", tmp_path_factory.mktemp("turn_base"))


def test_a_name_is_one_token_id_in_the_observation_and_inside_a_tool_call(turn_model):
    """The copy a policy must learn (observed name -> call argument) is an identity on token ids, and the
    tokenizer saved with the model still decodes every call byte for byte."""
    _, tok = load_policy(turn_model)
    observed = tok.tokenize("You arrive at sidetable 1. On the sidetable 1, you see a alarmclock 1.")
    call = '{"name": "track", "arguments": {"entity": "sidetable 1", "attribute": "searched", "value": "yes"}}'
    called = tok.tokenize(call)
    name = tok.tokenize("sidetable")  # one token on the full corpus; pieces on this tiny one, the same in both

    def holds(tokens: list[str]) -> bool:
        return any(tokens[i:i + len(name)] == name for i in range(len(tokens)))

    assert holds(observed) and holds(called)
    assert tok.decode(tok(call, add_special_tokens=False)["input_ids"]) == call


def test_trailing_space_pieces_keep_names_and_score_decoding_boundaries_for_fewer_tokens(tmp_path, turn_traces,
                                                                                        turn_model):
    """``model.pieces: trailing-space``: a name is the same ids in an observation and in a call; the pieces score
    decoding joins (prompt, act opening, candidate command with its closing) tokenize as the whole text does; and
    the same trace text takes fewer tokens than with words-apart pieces."""
    _, apart = load_policy(turn_model)
    _, tok = load_policy(build_default_model(dataclasses.replace(TINY_MODEL, pieces="trailing-space"),
                                             turn_traces / "train.jsonl", tmp_path / "base"))
    observed = tok.tokenize("You arrive at sidetable 1. On the sidetable 1, you see a alarmclock 1.")
    call = '{"name": "track", "arguments": {"entity": "sidetable 1", "attribute": "location", "value": "inventory"}}'
    name = tok.tokenize("sidetable 1")
    assert name[-1] == "1"

    def holds(tokens: list[str]) -> bool:
        return any(tokens[i:i + len(name)] == name for i in range(len(tokens)))

    assert holds(observed) and holds(tok.tokenize(call))
    assert tok.decode(tok(call, add_special_tokens=False)["input_ids"]) == call
    prompt = tok.apply_chat_template([{"role": "user", "content": "Task: put a cd in safe.\nObservation: hi"}],
                                     add_generation_prompt=True, tokenize=False)
    for head, cand in [(EMPTY_THINK + ACT_PREFIX, "go to sidetable 1" + COMMAND_CLOSE),
                       (EMPTY_THINK + ACT_PREFIX, "look" + COMMAND_CLOSE),
                       ('<tool_call>\n{"name": "track", "arguments": {' + ENTITY_OPEN, "cd 3" + ENTITY_CLOSE)]:
        parts = sum((tok(t, add_special_tokens=False)["input_ids"] for t in (prompt, head, cand)), [])
        assert parts == tok(prompt + head + cand, add_special_tokens=False)["input_ids"], (head, cand)
    text = "".join(json.loads(line)["prompt"][-1]["content"]
                   for line in (turn_traces / "train.jsonl").read_text().splitlines()[:50])
    assert len(tok.tokenize(text)) < 0.9 * len(apart.tokenize(text))


def test_sft_on_turn_examples_trains_completions_and_records_the_layout(tmp_path, turn_traces, turn_model):
    spec = {"model_path": turn_model, "train_file": str(turn_traces / "train.jsonl"), "output_dir": str(tmp_path),
            "sft": dataclasses.asdict(SFTStageConfig(max_steps=2, per_device_train_batch_size=4, logging_steps=1,
                                                     sampling="group_by_length", bf16=True)),
            "layout": layout_of(TURN)}
    out = accelerate_launch("evoharness.training.sft", spec, tmp_path, num_processes=1)
    assert out["global_step"] == 2 and out["first_loss"] > 0 and out["tokens_seen"] > 0
    model, _ = load_policy(out["final_path"])
    assert model.config.evoharness_layout == layout_of(TURN)


class RecordingEnv:
    """A real ALFWorld game that checks every executed command against the admissible list of that state."""

    def __init__(self, env):
        self.env, self.game, self.task_type = env, env.game, env.task_type
        self.admissible, self.commands = [], []

    def reset(self, seed=0):
        res = self.env.reset(seed)
        self.admissible = res.admissible_commands
        return res

    def step(self, command):
        assert command in self.admissible, f"{command!r} not admissible"
        self.commands.append(command)
        res = self.env.step(command)
        self.admissible = res.admissible_commands
        return res


@pytest.mark.parametrize("game", list_games("valid_seen", limit=2, stride=70))
def test_score_decoding_only_executes_admissible_commands(game, turn_model):
    model, tok = load_policy(turn_model)  # untrained: its free text is mostly malformed, the worst case
    policy = LMPolicy(model, tok, max_new_tokens=24, context="turn", decoding="score")
    env = RecordingEnv(ALFWorldEnv(game, max_steps=20, expert=False))
    ws = Workspace.from_config(ExperienceStore(), "t", TURN)
    res = run_episode(env, policy, ws, CostConfig(), max_env_steps=6, max_meta_actions=2, view=turn_view(TURN))
    env.env.close()
    assert res.env_steps == len(env.commands) > 0 and res.remapped == 0
    assert policy.scored >= res.env_steps  # every command came from scoring (the closing note turn may add one)


def test_cached_candidate_scores_equal_a_full_forward_pass_per_candidate(turn_model):
    import torch

    model, tok = load_policy(turn_model)
    policy = LMPolicy(model, tok, context="turn", decoding="score", chunk=2)  # 3 candidates: two chunks
    context = tok("Task: put a mug in cabinet. Observation: You arrive at cabinet 1.", add_special_tokens=False)[
        "input_ids"]
    cands = [tok(c, add_special_tokens=False)["input_ids"] for c in ["go to cabinet 10", "go to cabinet 1", "look"]]
    got = policy.score_continuations(context, cands)
    with torch.no_grad():
        for c, score in zip(cands, got, strict=True):
            logp = torch.log_softmax(model(input_ids=torch.tensor([context + c])).logits[0].float(), dim=-1)
            want = [logp[len(context) - 1 + j, t].item() for j, t in enumerate(c)]
            assert score == pytest.approx(want, abs=1e-3)


def test_score_decoding_needs_the_turn_context(turn_model):
    model, tok = load_policy(turn_model)
    with pytest.raises(ValueError, match="turn context"):
        LMPolicy(model, tok, decoding="score")


def test_turn_view_reads_the_task_from_the_first_observation():
    view = TurnView(harness=False)
    view.start("Room.\n\nYour task is to: put a mug in cabinet.")
    view.record_act("go to cabinet 1", "Nothing happens.")
    assert view.prompt()[-1]["content"] == ("Task: put a mug in cabinet.\nRecent: go to cabinet 1 (nothing happened)\n"
                                            "Observation: Nothing happens.")


def test_lora_through_peft_is_set_by_config_and_merged_into_the_final_model(tmp_path, turn_traces, turn_model):
    spec = {"model_path": turn_model, "train_file": str(turn_traces / "train.jsonl"), "output_dir": str(tmp_path),
            "sft": dataclasses.asdict(SFTStageConfig(max_steps=1, per_device_train_batch_size=2, lora_r=4,
                                                     lora_alpha=8, gradient_checkpointing=True))}
    out = accelerate_launch("evoharness.training.sft", spec, tmp_path, num_processes=1)
    assert out["global_step"] == 1
    merged, _ = load_policy(out["final_path"])  # a plain model folder: no adapter left to load
    base, _ = load_policy(turn_model)
    assert type(merged).__name__ == "Qwen3ForCausalLM" and not (tmp_path / "final" / "adapter_config.json").exists()
    assert sum(p.numel() for p in merged.parameters()) == sum(p.numel() for p in base.parameters())


def test_a_call_that_leaves_the_prompt_unchanged_forces_an_act():
    """A deterministic policy repeating a call that changes nothing would loop until the turn budget; the loop flags
    the repeated prompt and a scoring policy then acts (counted as ``forced``)."""
    from evoharness.env.adapters import GymTextEnv
    from evoharness.policy.agent import Decision

    class Repeater:
        def __init__(self):
            self.flags = []

        def start(self, messages, tools):
            pass

        def decide(self, state):
            self.flags.append(state["force_act"])
            if state["force_act"]:
                return Decision("act", {"command": state["admissible_commands"][0]})
            return Decision("track", {"entity": "mug 1", "attribute": "location", "value": "cabinet 1"})

        def observe(self, text):
            pass

    class Room:
        def reset(self, seed=None):
            return "You are in a room.\n\nYour task is to: find the mug.", {"admissible_commands": ["look"]}

        def step(self, action):
            return "You see nothing.", 0.0, True, {"admissible_commands": ["look"], "won": False}

    pol = Repeater()
    res = run_episode(GymTextEnv(Room()), pol, Workspace(ExperienceStore(), "r"), CostConfig(), max_env_steps=3,
                      max_meta_actions=5, view=turn_view(TURN))
    # track (new fact), track again (same Belief, same "Last call") -> flagged, act; then the closing turn
    assert pol.flags[:3] == [False, False, True] and res.env_steps == 1 and res.meta_actions["track"] == 2


def test_grpo_step_in_the_turn_context_runs_on_a_real_game_and_resumes(tmp_path, turn_model):
    """Issue 6: one cost-aware GRPO step on a real game, its group = 2 episodes x 2 sampled turns each; the reward
    of every sample is its episode's won - cost, and a re-run with one more step resumes at step 1."""
    from evoharness.config import GRPOStageConfig

    game = list_games("train", limit=1, offset=1000)
    cfg = GRPOStageConfig(num_generations=2, turns_per_episode=2, prompts_per_step=1, max_steps=1, max_env_steps=3,
                          max_meta_actions=1, max_new_tokens=16, save_steps=1)
    spec = {"model_path": turn_model, "games": game, "output_dir": str(tmp_path),
            "experience_path": str(tmp_path / "exp.db"), "grpo": dataclasses.asdict(cfg),
            "cost": dataclasses.asdict(CostConfig()), "traces": dataclasses.asdict(TURN)}
    result = accelerate_launch("evoharness.training.grpo", spec, tmp_path, num_processes=1)
    assert result["global_step"] == 1 and result["resumed_from"] is None
    first = result["first"]
    assert first["env_steps"] == 3.0 and first["success_rate"] == 0.0  # 3 steps never win this game
    assert first["reward"] == pytest.approx(-first["cost"]) and first["cost"] > 0
    assert (tmp_path / "final" / "model.safetensors").exists()
    spec["grpo"]["max_steps"] = 2
    second = accelerate_launch("evoharness.training.grpo", spec, tmp_path, num_processes=1)
    assert second["resumed_from"].endswith("checkpoint-1") and second["global_step"] == 2


def test_grpo_in_two_processes_plays_every_game_once_and_merges_lora(tmp_path, turn_model):
    """Parallel rollout workers: under `accelerate/cpu_2proc.yaml` each of the 2 processes plays one of the step's 2
    games (2 episodes each); the logged step holds all 4 episodes once, and the LoRA adapter is merged into a plain
    model folder."""
    from evoharness.config import GRPOStageConfig
    from evoharness.training.model import load_policy

    games = list_games("train", limit=2, offset=1000)
    cfg = GRPOStageConfig(num_generations=2, turns_per_episode=1, prompts_per_step=2, max_steps=1, max_env_steps=2,
                          max_meta_actions=1, max_new_tokens=8, num_processes=2, lora_r=4, lora_alpha=8)
    spec = {"model_path": turn_model, "games": games, "output_dir": str(tmp_path),
            "experience_path": str(tmp_path / "exp.db"), "grpo": dataclasses.asdict(cfg),
            "cost": dataclasses.asdict(CostConfig()), "traces": dataclasses.asdict(TURN)}
    result = accelerate_launch("evoharness.training.grpo", spec, tmp_path, num_processes=2)
    assert result["world_size"] == 2 and result["global_step"] == 1
    history = (tmp_path / "history.jsonl").read_text().splitlines()
    assert len(history) == 1  # written once, by the main process
    step = json.loads(history[0])
    assert step["episodes"] == 4 and step["env_steps"] == 2.0
    assert step["reward"] == pytest.approx(-step["cost"])
    model, _ = load_policy(result["final_path"])  # merged: a plain Qwen3 model, no adapter left
    assert type(model).__name__ == "Qwen3ForCausalLM" and not any("lora" in n for n, _ in model.named_parameters())


def test_grpo_refuses_groups_that_would_straddle_processes():
    from evoharness.config import GRPOStageConfig

    with pytest.raises(ValueError, match="multiple of grpo.num_processes"):
        GRPOStageConfig(prompts_per_step=3, num_processes=2)


def test_sampled_turns_carry_what_the_policy_read_and_produced(turn_model):
    """Score decoding at a temperature records each turn: prompt ids = that turn's prompt, completion ids end with
    <|im_end|>, and every act completion decodes to the admissible command that was executed."""
    import torch

    from evoharness.training.rollouts import sample_turns

    torch.manual_seed(0)
    model, tok = load_policy(turn_model)
    policy = LMPolicy(model, tok, max_new_tokens=16, temperature=1.0, context="turn", decoding="score")
    env = RecordingEnv(ALFWorldEnv(list_games("valid_seen", limit=1)[0], max_steps=10, expert=False))
    ws = Workspace.from_config(ExperienceStore(), "t", TURN)
    res = run_episode(env, policy, ws, CostConfig(), max_env_steps=4, max_meta_actions=1, view=turn_view(TURN))
    env.env.close()
    assert len(policy.turns) >= res.env_steps == len(env.commands) == 4
    assert all(t["completion_ids"][-1] == policy.end_id for t in policy.turns)
    assert all(len(t["completion_ids"]) == len(t["logprobs"]) == len(t["env_mask"]) for t in policy.turns)
    # an act turn (forced here: the untrained model's own text is malformed) records the sampled command's tokens
    admissible = ["go to cabinet 1", "go to cabinet 2", "go to drawer 1", "go to shelf 3"]  # equal lengths
    prompt = [{"role": "user", "content": "Task: put a mug in cabinet.\nObservation: You are in a room."}]
    drawn = set()
    for _ in range(12):
        dec = policy.decide({"turn_messages": prompt, "admissible_commands": admissible, "force_act": True})
        turn = policy.turns[-1]
        text = tok.decode([t for t, m in zip(turn["completion_ids"], turn["env_mask"], strict=True) if m])
        assert dec.args["command"] in admissible and text.startswith(dec.args["command"] + '"}}')
        assert turn["prompt_ids"] == tok(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False),
                                         add_special_tokens=False)["input_ids"]
        drawn.add(dec.args["command"])
    assert len(drawn) > 1  # sampled at temperature 1, not greedy
    assert len(sample_turns(policy.turns, 3, seed=0)) == 3 and sample_turns([], 3, seed=0) == []


def test_a_generation_backend_without_stop_strings_is_cut_like_model_generate(turn_model):
    """`LMPolicy(generate_fn=...)` (vLLM's place in GRPO; vLLM itself needs a GPU, so a backend that returns a whole
    turn and more stands in): the turn is cut right after the act call's command opening, the command is then scored
    over the admissible ones, and without score decoding the turn ends at <|im_end|>."""
    from evoharness.policy.lm_policy import ACT_PREFIX, COMMAND_OPEN, EMPTY_THINK

    model, tok = load_policy(turn_model)
    act = tok(EMPTY_THINK + ACT_PREFIX, add_special_tokens=False)["input_ids"]
    rest = tok('go to desk 1"}}\n</tool_call><|im_end|>look look', add_special_tokens=False)["input_ids"]
    calls = []

    def backend(ids, max_new_tokens):
        calls.append((list(ids), max_new_tokens))
        return act + rest, [-0.5] * len(act + rest)

    prompt = [{"role": "user", "content": "Task: put a mug in cabinet.\nObservation: You are in a room."}]
    admissible = ["go to cabinet 1", "go to drawer 1"]
    policy = LMPolicy(model, tok, max_new_tokens=64, context="turn", decoding="score", generate_fn=backend)
    policy.start([], [])
    dec = policy.decide({"turn_messages": prompt, "admissible_commands": admissible})
    turn = policy.turns[-1]
    generated = [t for t, m in zip(turn["completion_ids"], turn["env_mask"], strict=True) if m]
    assert generated[:len(act)] == act and tok.decode(act).endswith(COMMAND_OPEN)  # cut at the command opening
    assert turn["logprobs"][:len(act)] == [-0.5] * len(act)
    assert dec.name == "act" and dec.args["command"] in admissible and not dec.malformed
    assert calls[0][0] == turn["prompt_ids"] and calls[0][1] == 64
    remap = LMPolicy(model, tok, max_new_tokens=64, context="turn", generate_fn=backend)
    remap.start([], [])
    dec = remap.decide({"turn_messages": prompt, "admissible_commands": admissible})
    assert dec.name == "act" and dec.args["command"] == "go to desk 1"  # the backend's own command, cut at the end
    assert remap.turns[-1]["completion_ids"] == act + rest[:rest.index(remap.end_id) + 1]


def test_ground_track_scores_a_tracks_names_over_the_latest_observation(turn_model):
    """`ground_track` (`evaluate.ground_track`): a backend that would track names the policy has not just read
    ("cd 9", "desk 7") gets its entity and its location value scored over the observation's names instead; the act
    after them is scored over the admissible commands, and the recorded turn holds the text that was played."""
    from evoharness.policy.lm_policy import ACT_PREFIX, EMPTY_THINK

    model, tok = load_policy(turn_model)
    script = [EMPTY_THINK + '<tool_call>\n{"name": "track", "arguments": {"entity": "cd 9", "attribute": "x',
              'location", "value": "desk 7"}}\n</tool_call>',
              "\n" + ACT_PREFIX + 'go to desk 7"}}\n</tool_call><|im_end|>']

    def backend(ids, max_new_tokens):
        ids = tok(script.pop(0) if script else "<|im_end|>", add_special_tokens=False)["input_ids"]
        return ids, [-0.5] * len(ids)

    observation = "You open the drawer 5. The drawer 5 is open. In it, you see a cd 3, and a cd 2."
    prompt = [{"role": "user", "content": "Task: look at cd under the desklamp.\nObservation: " + observation}]
    admissible = ["close drawer 5", "take cd 3 from drawer 5", "take cd 2 from drawer 5"]
    names = ["drawer 5", "cd 3", "cd 2"]
    policy = LMPolicy(model, tok, max_new_tokens=96, context="turn", decoding="score", generate_fn=backend,
                      ground_track=True)
    scored = []

    def last_wins(context, cands):  # the model's scores, but the last candidate made the likeliest
        scored.append(len(cands))
        got = LMPolicy.score_continuations(policy, context, cands)
        return [[x - 50.0 for x in t] if i < len(got) - 1 else t for i, t in enumerate(got)]

    policy.score_continuations = last_wins
    policy.start([], [])
    dec = policy.decide({"turn_messages": prompt, "admissible_commands": admissible, "observation": observation})
    assert policy.grounded == 2 and not script  # the entity, then the location value; three backend calls
    assert scored == [len(names), len(names) + 1, len(admissible)]  # the names; them and "inventory"; the commands
    assert dec.before == [("track", {"entity": "cd 2", "attribute": "location", "value": "inventory"})]
    assert dec.name == "act" and dec.args["command"] == "take cd 2 from drawer 5"
    played = tok.decode(policy.turns[-1]["completion_ids"], skip_special_tokens=False)
    assert '"entity": "cd 2", "attribute": "location", "value": "inventory"}}' in played
    assert "cd 9" not in played and "desk 7" not in played

    script[:] = [EMPTY_THINK + '<tool_call>\n{"name": "track", "arguments": {"entity": "cd 9", "attribute": '
                 '"location", "value": "desk 7"}}\n</tool_call>\n' + ACT_PREFIX]
    free = LMPolicy(model, tok, max_new_tokens=96, context="turn", decoding="score", generate_fn=backend)
    free.start([], [])
    dec = free.decide({"turn_messages": prompt, "admissible_commands": admissible, "observation": observation})
    assert dec.before == [("track", {"entity": "cd 9", "attribute": "location", "value": "desk 7"})]  # as generated


PARALLEL = dataclasses.replace(TURN, parallel_calls=True)


def _turn_calls(row):
    """Each example's tool calls as [(name, args), ...]."""
    return [[(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in r["completion"][0]["tool_calls"]]
            for r in row]


def test_parallel_calls_put_a_steps_meta_actions_and_its_act_in_one_example():
    """`traces.parallel_calls`: one example per environment step (plus the closing note), holding the same calls in
    the same order as the one-call-per-turn layout, each read from the prompt before the turn's meta-actions ran."""
    one = Teacher(TURN).annotate(episode())["turns"]
    par = Teacher(PARALLEL).annotate(episode())["turns"]
    calls = _turn_calls(par)
    assert [c for turn in calls for c in turn] == _calls(one)  # the same calls, in the same order
    acts = sum(n == "act" for n, _ in _calls(one))
    assert len(par) == acts + 1 == 10 and calls[-1] == [_calls(one)[-1]]  # the closing turn: the note alone
    assert all(turn[-1][0] == "act" and all(n != "act" for n, _ in turn[:-1]) for turn in calls[:-1])
    take = next(i for i, turn in enumerate(calls) if turn[-1] == ("act", {"command": "take mug 1 from cabinet 4"}))
    assert calls[take] == [("track", {"entity": "mug 1", "attribute": "location", "value": "cabinet 4"}),
                           ("commit", {"id": "find", "status": "done", "depends_on": []}),
                           ("act", {"command": "take mug 1 from cabinet 4"})]
    # read before its track and commit ran: nothing about the mug in the workspace yet, and no "Last call" line
    assert par[take]["prompt"][-1]["content"] == (
        "Task: put a hot mug in cabinet.\n"
        "Workspace: empty\n"
        "Lessons: no lessons yet\n"
        "Recent: go to cabinet 4 | put mug 1 in cabinet 4 (nothing happened) | open cabinet 4\n"
        "Observation: You open the cabinet 4. The cabinet 4 is open. In it, you see a mug 1.")
    assert calls[0][0] == ("recall", {"query": "mug"}) and calls[0][1][0] == "act"
    with pytest.raises(ValueError, match="parallel_calls: true needs"):
        TraceConfig(context="turn", harness=False, parallel_calls=True)


def test_parallel_calls_keep_meta_actions_whose_command_is_not_a_target():
    ep = episode()
    idx = next(i for i, r in enumerate(ep.records) if r["action"] == "take mug 1 from cabinet 4")
    ep.records[idx]["action_source"] = "random"  # a perturbed step: the command is history, not a target
    calls = _turn_calls(Teacher(PARALLEL).annotate(ep)["turns"])
    assert [("track", {"entity": "mug 1", "attribute": "location", "value": "cabinet 4"}),
            ("commit", {"id": "find", "status": "done", "depends_on": []})] in calls  # a turn without an act
    assert all(c != ("act", {"command": "take mug 1 from cabinet 4"}) for turn in calls for c in turn)


def test_a_turn_with_several_calls_runs_its_meta_actions_before_the_act():
    """`Decision.before`: the turn's meta-actions execute in order, then its act; an act ahead of another call is
    rejected, not played."""
    from evoharness.policy.agent import Decision, parse_tool_calls

    text = ('<tool_call>\n{"name": "track", "arguments": {"entity": "mug 1", "attribute": "location", "value": '
            '"desk 1"}}\n</tool_call>\n<tool_call>{broken</tool_call>\n<tool_call>\n{"name": "act", "arguments": '
            '{"command": "look"}}\n</tool_call>')
    assert parse_tool_calls(text) == [("track", {"entity": "mug 1", "attribute": "location", "value": "desk 1"}),
                                      ("act", {"command": "look"})]
    game = list_games("valid_seen", limit=1)[0]
    env = ALFWorldEnv(game, max_steps=10, expert=False)
    first = env.reset().admissible_commands[0]
    env.close()

    class OneTurn:
        def __init__(self):
            self.turns = 0

        def start(self, messages, tools):
            pass

        def decide(self, state):
            self.turns += 1
            if self.turns == 1:
                return Decision("act", {"command": first}, before=[
                    ("track", {"entity": "mug 1", "attribute": "location", "value": "desk 1"}),
                    ("act", {"command": "look"}),
                    ("commit", {"id": "find", "status": "active", "text": "find a mug"})])
            return Decision("note", {"lesson": "l", "tags": []})

        def observe(self, text):
            pass

    env = ALFWorldEnv(game, max_steps=10, expert=False)
    ws = Workspace(ExperienceStore(), "par")
    res = run_episode(env, OneTurn(), ws, CostConfig(per_generated_token=0.0, per_rejected_turn=0.05),
                      max_env_steps=1, max_meta_actions=5, view=turn_view(PARALLEL))
    env.close()
    assert [(e["turn"], e["ok"]) for e in res.transcript[:3]] == [("track", True), ("act", False), ("commit", True)]
    assert res.transcript[3]["turn"] == "act" and res.transcript[3]["command"] == first and res.env_steps == 1
    assert res.meta_actions == {"track": 1, "commit": 1, "recall": 0, "note": 1}
    assert res.malformed == 1 and res.rejected_turns == 1
    assert ws.belief[("mug 1", "location")].value == "desk 1"


def test_score_decoding_of_a_parallel_turn_returns_its_meta_actions_and_an_admissible_act(turn_model):
    """A generated turn of two meta-actions then an act's opening: the meta-actions come back in order as
    ``before``, and the command is scored over the admissible ones (the generation backend stands in for a model
    trained on parallel turns; the scoring runs on the real model)."""
    from evoharness.policy.lm_policy import EMPTY_THINK

    model, tok = load_policy(turn_model)
    text = (EMPTY_THINK + '<tool_call>\n{"name": "track", "arguments": {"entity": "mug 1", "attribute": "location", '
            '"value": "desk 1"}}\n</tool_call>\n<tool_call>\n{"name": "commit", "arguments": {"id": "find", "status": '
            '"done"}}\n</tool_call>\n<tool_call>\n{"name": "act", "arguments": {"command": "go to')
    gen = tok(text, add_special_tokens=False)["input_ids"]
    policy = LMPolicy(model, tok, max_new_tokens=256, context="turn", decoding="score",
                      generate_fn=lambda ids, n: (gen, [-0.1] * len(gen)))
    policy.start([], [])
    admissible = ["go to cabinet 1", "go to drawer 1"]
    dec = policy.decide({"turn_messages": [{"role": "user", "content": "Task: x"}], "admissible_commands": admissible})
    assert dec.name == "act" and dec.args["command"] in admissible and not dec.malformed
    assert dec.before == [("track", {"entity": "mug 1", "attribute": "location", "value": "desk 1"}),
                          ("commit", {"id": "find", "status": "done"})]


def _meta_only_backend(tok):
    """A generation backend that answers every turn with one track call and <|im_end|>: no act (a model trained on
    parallel turns does this where its teacher's command was not a target, e.g. after a perturbed random step)."""
    from evoharness.policy.lm_policy import EMPTY_THINK

    text = (EMPTY_THINK + '<tool_call>\n{"name": "track", "arguments": {"entity": "mug 1", "attribute": "location", '
            '"value": "desk 1"}}\n</tool_call><|im_end|>')
    gen = tok(text, add_special_tokens=False)["input_ids"]
    return gen, (lambda ids, n: (gen, [-0.1] * len(gen)))


def test_act_each_turn_scores_an_act_after_a_turn_of_meta_actions_only(turn_model):
    """`act_each_turn`: the generated track stays in `before`, an admissible act is scored right after its
    `</tool_call>` (opened as the chat template separates parallel calls), and the recorded turn marks that opening
    as not sampled. On the closing turn, and with the option off, the turn is the meta-action alone."""
    from evoharness.policy.lm_policy import ACT_PREFIX

    model, tok = load_policy(turn_model)
    gen, backend = _meta_only_backend(tok)
    track = ("track", {"entity": "mug 1", "attribute": "location", "value": "desk 1"})
    state = {"turn_messages": [{"role": "user", "content": "Task: x"}],
             "admissible_commands": ["go to cabinet 1", "go to drawer 1"]}
    policy = LMPolicy(model, tok, max_new_tokens=256, context="turn", decoding="score", generate_fn=backend,
                      act_each_turn=True)
    policy.start([], [])
    dec = policy.decide(state)
    assert dec.name == "act" and dec.args["command"] in state["admissible_commands"] and dec.before == [track]
    assert dec.appended and not dec.malformed and policy.appended == 1
    turn = policy.turns[-1]
    kept = gen[:gen.index(policy.end_id)]  # the generated call, up to and without <|im_end|>
    opening = tok("\n" + ACT_PREFIX, add_special_tokens=False)["input_ids"]
    assert turn["completion_ids"][:len(kept) + len(opening)] == kept + opening
    assert turn["env_mask"][:len(kept) + len(opening)] == [1] * len(kept) + [0] * len(opening)
    assert tok.decode(turn["completion_ids"][len(kept) + len(opening):]).startswith(dec.args["command"] + '"}}')
    assert policy.decide(state | {"closing": True}).name == "track"  # the closing turn: as generated
    off = LMPolicy(model, tok, max_new_tokens=256, context="turn", decoding="score", generate_fn=backend)
    off.start([], [])
    dec = off.decide(state)
    assert (dec.name, dec.args, dec.before, dec.appended) == (*track, [], False)


def test_act_each_turn_keeps_an_episode_stepping_where_meta_only_turns_stall(turn_model):
    """On a real game, a policy that only ever generates a track, 4 steps and 3 meta-actions allowed (9 turns): with
    `act_each_turn` each turn runs its track and then an admissible act (marked `appended` in the transcript), so
    all 4 steps are played. Without it the turns are tracks alone, an act comes only when a repeated turn left the
    prompt unchanged (`force_act`), and the turn budget is spent after 2 steps, 4 of its 7 tracks refused."""
    model, tok = load_policy(turn_model)
    _, backend = _meta_only_backend(tok)
    game = list_games("valid_seen", limit=1)[0]
    runs = {}
    for on in (True, False):
        policy = LMPolicy(model, tok, max_new_tokens=256, context="turn", decoding="score", generate_fn=backend,
                          act_each_turn=on)
        env = RecordingEnv(ALFWorldEnv(game, max_steps=10, expert=False))
        ws = Workspace.from_config(ExperienceStore(), f"a{on}", PARALLEL)
        runs[on] = run_episode(env, policy, ws, CostConfig(), max_env_steps=4, max_meta_actions=3,
                               view=turn_view(PARALLEL))
        env.env.close()
        assert env.commands == [e["command"] for e in runs[on].transcript if e["turn"] == "act"]
    on, off = runs[True], runs[False]
    assert [(e["turn"], e.get("ok"), e.get("appended")) for e in on.transcript] == \
        [("track", True, None), ("act", None, True)] * 3 + [("track", False, None), ("act", None, True)]
    assert on.env_steps == 4 and on.meta_actions["track"] == 3
    assert [e["turn"] for e in off.transcript] == ["track", "track", "act", "track", "track", "track", "act", "track",
                                                   "track"]
    assert off.env_steps == 2 and off.error == "turn budget spent"
    assert sum(e.get("ok") is False for e in off.transcript) == 4  # the tracks after the 3rd: over the budget


def test_evaluation_acts_each_turn_only_for_parallel_layouts_and_records_the_setting(turn_model, tmp_path):
    """`EvalConfig.act_each_turn` reaches the policy of a model read in the parallel-calls layout only, and is part of
    an evaluation's identity unless False (the value of every evaluation recorded before the setting existed)."""
    from evoharness.config import EvalConfig
    from evoharness.evaluation.evaluate import make_policy

    cfg = EvalConfig(decoding="score")
    assert make_policy(turn_model, cfg, tmp_path, PARALLEL).act_each_turn is True
    assert make_policy(turn_model, cfg, tmp_path, TURN).act_each_turn is False
    assert make_policy(turn_model, dataclasses.replace(cfg, act_each_turn=False), tmp_path, PARALLEL).act_each_turn \
        is False
    assert cfg.identity()["act_each_turn"] is True
    assert "act_each_turn" not in dataclasses.replace(cfg, act_each_turn=False).identity()


def test_evaluation_grounds_tracks_only_when_asked_and_records_the_setting(turn_model, tmp_path):
    """`EvalConfig.ground_track` reaches the policy, and is part of an evaluation's identity only when True (False is
    how every evaluation recorded before the setting existed played), so those folders still resume."""
    from evoharness.config import EvalConfig
    from evoharness.evaluation.evaluate import make_policy

    cfg = EvalConfig(decoding="score")
    assert make_policy(turn_model, cfg, tmp_path, PARALLEL).ground_track is False
    assert make_policy(turn_model, dataclasses.replace(cfg, ground_track=True), tmp_path, PARALLEL).ground_track
    assert "ground_track" not in cfg.identity()
    assert dataclasses.replace(cfg, ground_track=True).identity()["ground_track"] is True
    from evoharness.config import load_profile

    assert load_profile("full-parallel-3500").evaluate.ground_track
    assert not load_profile("full-turn-base").evaluate.ground_track  # the turn recipe before parallel calls


def test_ground_track_reads_the_latest_observation_in_a_real_episode(turn_model):
    """Through `run_episode` on a real game: a backend that tracks "cd 99" and "desk 77" every turn gets, instead, names
    of the observation the turn read (the room's first one, then each command's answer)."""
    from evoharness.policy.lm_policy import ACT_PREFIX, EMPTY_THINK, ENTITY_CLOSE, NAME

    model, tok = load_policy(turn_model)
    rest = '"location", "value": "desk 77"}}\n</tool_call>\n' + ACT_PREFIX

    def backend(ids, max_new_tokens):  # the scripted turn's continuation of what the turn holds so far
        so_far = tok.decode(ids, skip_special_tokens=False).rsplit("<|im_start|>assistant\n", 1)[-1]
        opening = EMPTY_THINK + '<tool_call>\n{"name": "track", "arguments": {"entity": "cd 99", "attribute": '
        text = (rest[1:] if so_far.endswith(ENTITY_CLOSE) else "\n" + ACT_PREFIX if so_far.endswith("</tool_call>")
                else opening + rest)
        out = tok(text, add_special_tokens=False)["input_ids"]
        return out, [-0.5] * len(out)

    policy = LMPolicy(model, tok, max_new_tokens=96, context="turn", decoding="score", generate_fn=backend,
                      ground_track=True, act_each_turn=True)
    env = RecordingEnv(ALFWorldEnv(list_games("valid_seen", limit=1)[0], max_steps=10, expert=False))
    observation = env.env.reset().observation  # the room, as the episode's reset will show it
    ws = Workspace.from_config(ExperienceStore(), "t", PARALLEL)
    res = run_episode(env, policy, ws, CostConfig(), max_env_steps=3, max_meta_actions=5, view=turn_view(PARALLEL))
    env.env.close()
    grounded = free = 0
    for entry in res.transcript:
        if entry["turn"] == "track":
            names = NAME.findall(observation)
            if names:
                assert entry["args"]["entity"] in names and entry["args"]["value"] in names + ["inventory"]
                grounded += 1
            else:  # "you see nothing": no name to score over, the call as generated
                assert entry["args"] == {"entity": "cd 99", "attribute": "location", "value": "desk 77"}
                free += 1
        elif entry["turn"] == "act":
            observation = entry["result"]
    assert res.env_steps == 3 and grounded >= 1 and grounded + free == res.env_steps and policy.grounded == 2 * grounded
    from evoharness.evaluation.evaluate import summarize

    assert res.grounded_names == policy.grounded  # the episode's count: every turn's, the closing one's included
    assert summarize([res], "valid_seen", 1)["grounded_names_per_episode"] == policy.grounded
    old = dataclasses.replace(res, grounded_names=None)  # resumed from a folder written before the count existed
    assert summarize([res, old], "valid_seen", 2)["grounded_names_per_episode"] is None


def test_ground_track_with_model_generate_keeps_every_turn_whole(turn_model):
    """The path evaluation runs (`model.generate` with the three stop strings, called again after each scored name):
    on a real game the episode plays its steps, every recorded turn has one log-probability and one mask entry per
    token, and every executed `track` after an observation with names is grounded in it."""
    from evoharness.policy.lm_policy import NAME

    model, tok = load_policy(turn_model)
    policy = LMPolicy(model, tok, max_new_tokens=48, context="turn", decoding="score", ground_track=True,
                      act_each_turn=True)
    env = RecordingEnv(ALFWorldEnv(list_games("valid_seen", limit=1)[0], max_steps=10, expert=False))
    observation = env.env.reset().observation
    ws = Workspace.from_config(ExperienceStore(), "t", PARALLEL)
    res = run_episode(env, policy, ws, CostConfig(), max_env_steps=3, max_meta_actions=5, view=turn_view(PARALLEL))
    env.env.close()
    assert res.env_steps == 3 and res.remapped == 0
    assert all(len(t["completion_ids"]) == len(t["logprobs"]) == len(t["env_mask"]) for t in policy.turns)
    for entry in res.transcript:
        if entry["turn"] == "track" and NAME.findall(observation):
            assert entry["args"]["entity"] in NAME.findall(observation)
        elif entry["turn"] == "act":
            observation = entry["result"]


def test_grpo_rollouts_ground_tracks_when_the_profile_says(turn_model, tmp_path, monkeypatch):
    """`grpo.ground_track` reaches the policy that plays a GRPO rollout (on in `full-parallel`, as its evaluation)."""
    import evoharness.policy.lm_policy
    from evoharness.config import GRPOStageConfig, load_profile
    from evoharness.training.rollouts import TurnRollouts

    made = []

    class Recording(LMPolicy):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append((self.ground_track, self.act_each_turn))

    monkeypatch.setattr(evoharness.policy.lm_policy, "LMPolicy", Recording)
    model, tok = load_policy(turn_model)
    game = list_games("train", limit=1, offset=1000)[0]
    for on in (True, False):
        cfg = GRPOStageConfig(max_env_steps=1, max_meta_actions=1, max_new_tokens=16, ground_track=on)
        rollouts = TurnRollouts({}, cfg, CostConfig(), str(tmp_path / "exp.db"), str(tmp_path / "h.jsonl"),
                                workspace_cfg=PARALLEL)
        res, _ = rollouts.play(model, tok, game, f"e{on}", seed=0)
        assert res.env_steps == 1
    assert made == [(True, True), (False, True)]
    assert load_profile("full-parallel").grpo.ground_track and not load_profile("scratch").grpo.ground_track


def _lesson_prompts(prompts):
    return [i for i, p in enumerate(prompts) if "\nLessons: " in p[-1]["content"]]


def test_lesson_turns_show_a_recalls_lessons_until_the_next_command_in_traces_and_at_run_time():
    """`traces.lesson_turns: 1`: the lessons of a `recall` are on the prompts up to the first command issued after a
    prompt showed them, and the teacher's traces and a run-time episode put them on the same turns."""
    from evoharness.policy.agent import Decision

    ep = episode()
    one = Teacher(dataclasses.replace(TURN, lesson_turns=1)).annotate(ep)["turns"]
    names = [n for n, _ in _calls(one)]
    # one call per turn: only the prompt right after the opening recall (the default shows them to the end)
    assert names[0] == "recall" and _lesson_prompts([t["prompt"] for t in one]) == [1]
    assert len(_lesson_prompts([t["prompt"] for t in Teacher(TURN).annotate(ep)["turns"]])) == len(one) - 1
    par = Teacher(dataclasses.replace(PARALLEL, lesson_turns=1)).annotate(ep)["turns"]
    # parallel calls: the first turn's recall runs beside its act, so the second turn reads the lessons, once
    assert _lesson_prompts([t["prompt"] for t in par]) == [1]
    assert "\nLessons: no lessons yet\n" in par[1]["prompt"][-1]["content"]
    assert all("Lessons" not in t["prompt"][-1]["content"] for t in par[2:])

    class RecallThenAct:  # the teacher's parallel opening: recall beside the first act, then acts
        def __init__(self):
            self.prompts = []

        def start(self, messages, tools):
            pass

        def decide(self, state):
            self.prompts.append(state["turn_messages"])
            before = [("recall", {"query": "mug"})] if len(self.prompts) == 1 else []
            return Decision("act", {"command": state["admissible_commands"][0]}, before=before)

        def observe(self, text):
            pass

    env = ALFWorldEnv(list_games("valid_seen", limit=1)[0], max_steps=10, expert=False)
    policy = RecallThenAct()
    run_episode(env, policy, Workspace(ExperienceStore(), "lessons"), CostConfig(), max_env_steps=4,
                max_meta_actions=5, view=turn_view(dataclasses.replace(PARALLEL, lesson_turns=1)))
    env.close()
    assert _lesson_prompts(policy.prompts[:4]) == [1]
    with pytest.raises(ValueError, match="lesson_turns is -1"):
        TraceConfig(context="turn", lesson_turns=-1)


@pytest.mark.slow
def test_grpo_trains_every_turn_with_gigpo_advantages_on_a_real_game(turn_model, tmp_path):
    """`grpo.turns_per_group` with `grpo.advantage: gigpo`: a real GRPO step on a train game, every recorded turn of
    the group's two episodes a sample (none dropped), each turn recorded with its anchor state; the step trains in
    passes of 8 samples (gradient accumulation)."""
    from evoharness.config import GRPOStageConfig
    from evoharness.training.rollouts import TurnRollouts

    game = list_games("train", limit=1, offset=1000)
    cfg = GRPOStageConfig(num_generations=2, prompts_per_step=1, max_steps=1, max_env_steps=3, max_meta_actions=2,
                          max_new_tokens=16, turns_per_group=24, advantage="gigpo", ground_track=True,
                          micro_batch_size=8)  # 3 passes of 8 samples, one optimizer update
    spec = {"model_path": turn_model, "games": game, "output_dir": str(tmp_path / "grpo"),
            "experience_path": str(tmp_path / "exp.db"), "grpo": dataclasses.asdict(cfg),
            "cost": dataclasses.asdict(CostConfig()), "traces": dataclasses.asdict(PARALLEL)}
    result = accelerate_launch("evoharness.training.grpo", spec, tmp_path / "grpo", num_processes=1)
    first = result["first"]
    assert result["global_step"] == 1 and first["episodes"] == 2 and first["env_steps"] == 3.0
    assert first["turns_dropped"] == 0 and 6 <= first["turns_trained"] <= 23  # 3 acts per episode at least
    model, tok = load_policy(turn_model)
    rollouts = TurnRollouts({}, cfg, CostConfig(), str(tmp_path / "exp.db"), str(tmp_path / "h.jsonl"),
                            workspace_cfg=PARALLEL)
    _, turns = rollouts.play(model, tok, game[0], "anchors", seed=0)
    env = ALFWorldEnv(game[0], expert=False)
    first_observation = env.reset().observation
    env.close()
    assert turns[0]["anchor"] == first_observation  # every episode of the game shares its first state
