"""Batched policy inference (``evoharness.policy.batching``, ``evoharness.policy.batched_play``,
``evoharness.env.pool``): the
committed release, real ``valid_seen`` games, real environment processes."""

import dataclasses
import json
import os
import signal
import threading
from pathlib import Path

import pytest

from evoharness.env.alfworld import list_games
from evoharness.env.pool import EnvWorker, RemoteEnv
from evoharness.evaluation.evaluate import spread
from evoharness.policy.batching import BatchEngine
from evoharness.policy.lm_policy import COMMAND_OPEN, ENTITY_OPEN, VALUE_OPEN, LMPolicy

RELEASE = Path(__file__).resolve().parent.parent / "models" / "evoharness-full-sft"


@pytest.fixture(scope="module")
def release_model():
    from evoharness.training.model import load_policy

    model, tok = load_policy(str(RELEASE))
    return model.eval(), tok


def _prompts(tok, n):
    out = []
    for i in range(n):  # lengths differ, so the batch is left-padded
        obs = "You are in the middle of a room. You see a cabinet 1, a drawer %d, a sofa 1. " % (i + 1) * (1 + i % 3)
        msgs = [{"role": "system", "content": "You are an agent."},
                {"role": "user", "content": obs + "Your task is to: put a pencil in drawer."}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def _serve(engine, calls):
    """Run ``calls`` (functions of no argument) in threads against ``engine``; returns their results."""
    results = [None] * len(calls)

    def run(k):
        try:
            results[k] = calls[k]()
        finally:
            engine.close()

    engine.open(len(calls))
    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for t in threads:
        t.start()
    engine.serve()
    for t in threads:
        t.join()
    return results


def test_one_batch_generates_and_scores_what_each_prompt_alone_gives(release_model):
    model, tok = release_model
    prompts = _prompts(tok, 6)
    alone = LMPolicy(model, tok, 64, context="turn", decoding="score")
    stops = [[COMMAND_OPEN, ENTITY_OPEN, VALUE_OPEN] if i % 2 else [COMMAND_OPEN] for i in range(6)]
    budgets = [64 - 7 * i for i in range(6)]  # each row its own budget and stop strings
    cands = [tok(c, add_special_tokens=False)["input_ids"] for c in ("go to cabinet 1", "look", "open drawer 12")]
    engine = BatchEngine(model, tok, batch_generation=True)
    batched = _serve(engine, [lambda i=i: (engine.generate(prompts[i], stops[i], budgets[i], 0.0),
                                           engine.score(prompts[i], cands)) for i in range(6)])
    assert engine.stats["generate_batches"] == 1 and engine.stats["score_batches"] == 1  # all six in one pass
    for i in range(6):
        gen, logps = alone._generate(prompts[i], stops[i], budgets[i])
        (bgen, blogps), bscores = batched[i]
        assert bgen == gen and len(bgen) <= budgets[i]
        assert max(abs(a - b) for a, b in zip(logps, blogps)) < 1e-4
        for ref, got in zip(alone.score_continuations(prompts[i], cands), bscores):
            assert len(ref) == len(got) and max(abs(a - b) for a, b in zip(ref, got)) < 1e-4
    assert any(len(b[0][0]) < budgets[i] for i, b in enumerate(batched))  # some rows stopped on their own


def test_scoring_after_a_generated_turn_continues_from_its_kept_cache(release_model):
    """An act's command is scored right after the turn that opened it: the engine feeds only the turn's last token
    and the candidates on top of the KV cache the generation left, and gives what a fresh prefill gives."""
    model, tok = release_model
    prompts = _prompts(tok, 4)
    alone = LMPolicy(model, tok, 40, context="turn", decoding="score")
    cands = [tok(c + '"}}\n</tool_call>', add_special_tokens=False)["input_ids"]
             for c in ("go to cabinet 1", "go to drawer 2", "look", "inventory", "open drawer 12")]
    engine = BatchEngine(model, tok)

    def turn(i):
        gen, _ = engine.generate(prompts[i], [COMMAND_OPEN], 40, 0.0)
        return gen, engine.score(prompts[i] + gen, cands)

    batched = _serve(engine, [lambda i=i: turn(i) for i in range(4)])
    assert engine.stats["score_prefix_hits"] == 4  # every score continued from its turn's cache
    for i, (gen, scores) in enumerate(batched):
        for ref, got in zip(alone.score_continuations(prompts[i] + gen, cands), scores):
            assert len(ref) == len(got) and max(abs(a - b) for a, b in zip(ref, got)) < 1e-4


def test_a_turn_continues_from_the_prefix_it_shares_with_a_kept_one(release_model):
    """Generation after a scored name, or the next turn's prompt, encodes only what no kept sequence covers, and
    generates what a fresh prompt generates."""
    model, tok = release_model
    first = _prompts(tok, 1)[0]
    alone = LMPolicy(model, tok, 30, context="turn", decoding="score")
    engine = BatchEngine(model, tok)
    longer = first + tok(" open drawer 1", add_special_tokens=False)["input_ids"]

    reused = []

    def call(ids):
        before = engine.stats["prefix_tokens_reused"]
        out = engine.generate(ids, [COMMAND_OPEN], 30, 0.0)
        reused.append(engine.stats["prefix_tokens_reused"] - before)
        return out

    def episode():
        gen, _ = call(first)
        return gen, call(first + gen + [7, 8]), call(longer)

    gen, (second, second_lp), (third, _) = _serve(engine, [episode])[0]
    ref, ref_lp = alone._generate(first + gen + [7, 8], [COMMAND_OPEN], 30)
    assert second == ref and max(abs(a - b) for a, b in zip(second_lp, ref_lp)) < 1e-4
    assert third == alone._generate(longer, [COMMAND_OPEN], 30)[0]
    # nothing kept at first; then the first's prompt and turn (but the turn's last token, never fed); then at
    # least the first's prompt but its last token (more when the new text's first token happens to match)
    assert reused[0] == 0 and reused[1] == len(first) + len(gen) - 1 and reused[2] >= len(first) - 1


def test_a_failing_batch_raises_in_every_waiting_episode(release_model):
    model, tok = release_model
    engine = BatchEngine(model, tok)
    errors = _serve(engine, [lambda: _raises(lambda: engine.score([10**6, 1], [[1]]))] * 2)
    # a token id past the vocabulary: the forward pass itself failed
    assert all(isinstance(e, IndexError) for e in errors)


def _raises(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def test_batched_evaluation_plays_what_batch_1_plays(tmp_path):
    """Three valid_seen games, 5 steps, the release's settings: every episode makes the same calls with the same
    commands as one at a time, until (if ever) a recall returns a lesson noted by an episode that, one at a time,
    had ended before it (the first game's episode has no such lesson)."""
    from evoharness.evaluation.evaluate import evaluate
    from evoharness.registry.release import experience_path, play_settings

    cfg, cost = play_settings(RELEASE)
    cfg = dataclasses.replace(cfg, max_env_steps=5, workers=1)
    games = spread(list_games("valid_seen"), 3)
    one = evaluate(str(RELEASE), games, cfg, cost, tmp_path / "one", experience_path(RELEASE), progress=None)
    lines = []
    three = evaluate(str(RELEASE), games, dataclasses.replace(cfg, batch_episodes=3), cost, tmp_path / "three",
                     experience_path(RELEASE), progress=lines.append)
    rows = {n: [json.loads(x) for x in (tmp_path / n / "transcripts.jsonl").read_text().splitlines()]
            for n in ("one", "three")}
    assert [r["game"] for r in rows["three"]] == games  # written as they end, ordered by game at the end
    assert one["episodes"] == three["episodes"] == 3
    calls = {n: [[(e["turn"], e.get("command"), e.get("args"), e.get("result")) for e in r["transcript"]]
                 for r in rows[n]] for n in rows}
    assert calls["three"][0] == calls["one"][0]
    for a, b in zip(calls["one"][1:], calls["three"][1:]):
        first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is not None:  # explained only by a recall that saw other lessons
            assert any(x[0] == "recall" and x[3] != y[3] for x, y in zip(a[:first + 1], b[:first + 1]))
        else:
            assert len(a) == len(b)
    assert three["episodes"] == 3 and sum(1 for x in lines if "episodes/min" in x) == 3


def test_an_environment_process_is_recycled_and_replaced_when_killed():
    game = list_games("valid_seen")[0]
    worker = EnvWorker(recycle_every=2)
    pids = []
    for _ in range(3):
        env = RemoteEnv(worker, game, 10, False, None)
        pids.append(worker._proc.pid)
        assert env.task_type and "You are in the middle of a room" in env.reset(0).observation
        env.close()
    assert pids[0] == pids[1] != pids[2]  # a fresh process after every 2 episodes
    env = RemoteEnv(worker, game, 10, False, None)
    env.reset(0)
    os.kill(worker._proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="environment process died during step"):
        env.step("look")
    env.close()
    again = RemoteEnv(worker, game, 10, False, None)  # the next episode gets a new process
    assert "You are in the middle of a room" in again.reset(0).observation
    again.close()
    worker.stop()


def test_a_game_that_cannot_load_names_itself(tmp_path):
    worker = EnvWorker()
    with pytest.raises(Exception, match="no-such-game"):
        RemoteEnv(worker, str(tmp_path / "no-such-game"), 10, False, None)
    worker.stop()
