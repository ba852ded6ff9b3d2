import multiprocessing
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from evoharness.config import CostConfig
from evoharness.harness.workspace import ExperienceStore, Workspace, tokens


def ws():
    return Workspace(ExperienceStore(), "ep", render_budget_tokens=40)


def test_track_replaces_superseded_fact():
    w = ws()
    assert w.call("track", {"entity": "apple 1", "attribute": "location", "value": "countertop 1"}, 3) == \
        ("ok: apple 1 location = countertop 1", True)
    w.call("track", {"entity": "apple 1", "attribute": "location", "value": "inventory"}, 5)
    assert {k: (f.value, f.step) for k, f in w.belief.items()} == {("apple 1", "location"): ("inventory", 5)}
    assert w.usage.calls["track"] == 2


def test_commit_rejects_unknown_dependency_and_cycle():
    w = ws()
    assert w.call("commit", {"id": "take", "status": "pending", "depends_on": ["find"]})[1] is False
    assert w.call("commit", {"id": "find", "status": "done"}) == ("ok: find done", True)
    assert w.call("commit", {"id": "take", "status": "active", "depends_on": ["find"]})[1]
    text, ok = w.call("commit", {"id": "find", "status": "done", "depends_on": ["take"]})
    assert not ok and "cycle" in text
    assert w.progress["find"].depends_on == []
    text, ok = w.call("commit", {"id": "x", "status": "maybe"})
    assert not ok and "status 'maybe'" in text
    assert w.usage.calls["commit"] == 2 and w.usage.invalid_calls == 3


def test_invalid_arguments_give_errors_not_exceptions():
    w = ws()
    assert w.call("track", {"entity": "a"})[1] is False
    assert w.call("note", "not a dict")[1] is False
    assert w.call("fly", {})[0].startswith("error: unknown meta-action")


def test_recall_ranks_by_bm25_and_note_merges_duplicates():
    store = ExperienceStore()
    w = Workspace(store, "ep", recall_top_k=1)
    w.call("note", {"lesson": "apple was found at a countertop", "tags": ["pick"]})
    w.call("note", {"lesson": "mug was found at a cabinet", "tags": ["heat"]})
    w.call("note", {"lesson": "mug was found at a cabinet", "tags": ["heat"]})
    text, ok = w.call("recall", {"query": "heat a mug"})
    assert ok and text.endswith("mug was found at a cabinet") and text.startswith("[")
    lessons = store.all()
    assert [lesson["count"] for lesson in lessons] == [1, 2] and lessons[1]["uses"] == 1


def test_render_collapses_done_goals_and_keeps_budget():
    w = ws()
    w.call("commit", {"id": "find", "status": "done", "text": "find a mug"})
    w.call("commit", {"id": "goal", "status": "active", "text": "put a hot mug in cabinet"})
    for i in range(30):
        w.call("track", {"entity": f"mug {i}", "attribute": "location", "value": f"cabinet {i}"}, i)
    text = w.render()
    assert text.startswith("Progress: done find; goal active: put a hot mug in cabinet")
    assert "mug 29 location=cabinet 29" in text and "mug 0 " not in text
    assert len(tokens(text)) <= 40


def test_cost_formula():
    w = ws()
    w.call("track", {"entity": "a 1", "attribute": "location", "value": "b 1"})
    w.usage.generated_tokens = 100
    cfg = CostConfig(per_call={"track": 0.1}, per_call_token=0.01, per_generated_token=0.001)
    assert abs(w.usage.cost(cfg) - (0.1 + 0.01 * w.usage.call_tokens + 0.1)) < 1e-12
    assert w.usage.call_tokens == len(tokens('{"entity": "a 1", "attribute": "location", "value": "b 1"}')) + \
        len(tokens("ok: a 1 location = b 1"))


name = st.sampled_from(["track", "commit", "recall", "note", "bogus"])
args = st.dictionaries(st.sampled_from(["entity", "attribute", "value", "id", "status", "depends_on", "query",
                                        "lesson", "tags", "text"]),
                       st.one_of(st.text(max_size=12), st.sampled_from(["done", "active", "pending"]),
                                 st.lists(st.sampled_from(["a", "b", "c"]), max_size=3)), max_size=6)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(name, args), max_size=25))
def test_any_meta_action_sequence_leaves_a_valid_workspace(calls):
    w = ws()
    for n, a in calls:
        text, ok = w.call(n, a)
        assert isinstance(text, str) and isinstance(ok, bool)
    for g in w.progress.values():
        assert g.status in ("pending", "active", "done", "failed")
        assert all(d in w.progress for d in g.depends_on)
    assert len(tokens(w.render())) <= 40


def _writer(path, tag):
    store = ExperienceStore(path)
    for i in range(100):
        store.add(f"lesson {tag} {i}", [tag])
        store.add("a shared lesson", [])


def test_two_concurrent_writer_processes_lose_no_lesson(tmp_path):
    path = tmp_path / "exp.db"
    ExperienceStore(path)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(path), t)) for t in ("a", "b")]
    [p.start() for p in procs]
    [p.join(60) for p in procs]
    assert [p.exitcode for p in procs] == [0, 0]
    lessons = ExperienceStore(path).all()
    assert len(lessons) == 201
    assert [x["count"] for x in lessons if x["text"] == "a shared lesson"] == [200]


def _open_new_stores(folder, trials, barrier, tag):
    for trial in range(trials):
        barrier.wait(timeout=60)
        ExperienceStore(f"{folder}/exp{trial}.db").add(f"lesson {tag}", [tag])


def test_processes_opening_a_new_store_at_once_all_succeed(tmp_path):
    """The ranks of ``accelerate launch`` create the GRPO Experience store together (CI saw 'database is locked').

    Four spawned processes (not forked: a fork of this threaded pytest process can inherit a held lock and hang)
    meet at a barrier before each of 25 new stores, so every store is opened by four processes at once.
    """
    trials = 25
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_open_new_stores, args=(str(tmp_path), trials, barrier, t), daemon=True)
             for t in range(4)]
    try:
        [p.start() for p in procs]
        [p.join(120) for p in procs]
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    finally:
        [p.kill() for p in procs if p.is_alive()]  # a hung one must not keep pytest from exiting
    for trial in range(trials):
        texts = sorted(x["text"] for x in ExperienceStore(tmp_path / f"exp{trial}.db").all())
        assert texts == [f"lesson {t}" for t in range(4)], f"store {trial}"


def test_profiles_resolve_and_bad_ones_name_the_problem(tmp_path):
    import pytest

    from evoharness.config import known_profiles, load_profile

    cfg = load_profile("default", {"evaluate": {"limit": 3}})
    assert cfg.evaluate.limit == 3 and cfg.sft.num_processes == 2 and cfg.collect.num_games == 60
    assert load_profile("tiny").grpo.num_generations == 2
    product = {p.stem for p in (Path(__file__).parents[1] / "profiles").glob("*.yaml")}
    assert {"default", "scratch", "tiny", "full", "full-plain", "paper"} <= product  # the records: experiments/
    shipped = {name: load_profile(name) for name in known_profiles()}  # every record still loads by name
    assert {"full-plain-3500", "full-parallel", "full-seed1-60min"} <= set(shipped)
    plain = shipped["full-plain-3500"]   # (c) like-for-like with (d): same steps, batch and tokenizer rule as full-3500
    assert (plain.traces.harness, plain.sft.max_steps, plain.sft.num_processes * plain.sft.per_device_train_batch_size,
            plain.registered_model_name) == (False, 3500, 32, "evoharness-plain-full")
    par = shipped["full-parallel"]  # (d) in parallel turns against (c): same games and batch, (c)'s training tokens
    assert (par.traces.harness, par.traces.parallel_calls, par.sft.max_steps,
            par.sft.num_processes * par.sft.per_device_train_batch_size, par.collect.path, par.evaluate.workers) == (
            True, True, 1800, 32, plain.collect.path, 2)
    quarter = [shipped[f"quarter-{k}"] for k in ("plain", "harness", "parallel")]  # one data set, one budget
    assert {(q.collect.stride, q.collect.path, q.sft.max_steps, q.evaluate.limit) for q in quarter} == {
        (4, "data-quarter", 1000, 70)}
    assert [(q.traces.harness, q.traces.parallel_calls) for q in quarter] == [
        (False, False), (True, False), (True, True)]
    with pytest.raises(FileNotFoundError, match="available: .*default"):
        load_profile("nope")
    cases = {"evaluate:\n": None, "collect: 5\n": "section 'collect' must be a mapping",
             "evaluate:\n  limit: twelve\n": "evaluate.limit is 'twelve' \\(str\\); expected int",
             "sft:\n  epochs: 3\n": "unknown fields \\['epochs'\\]", "grpo:\n  temperature: 0\n": "temperature is 0",
             "model:\n  path: models:/evoharness-policy@champion\n": "pin a version"}
    for text, error in cases.items():
        path = tmp_path / "p.yaml"
        path.write_text(text)
        if error is None:
            assert load_profile(str(path), {"evaluate": {"limit": 1}}).evaluate.limit == 1
        else:
            with pytest.raises(ValueError, match=error):
                load_profile(str(path))


def test_dotted_overrides_reach_every_field_with_its_type_checked():
    import pytest

    from evoharness.config import load_profile, parse_overrides

    over = parse_overrides(["sft.learning_rate=1e-3", "traces.recent_actions=4", "evaluate.limit=0",
                            "cost.per_call.track=0.05", "model.path=models/x", "registered_model_name=other"])
    cfg = load_profile("full", over)
    got = (cfg.sft.learning_rate, cfg.traces.recent_actions, cfg.evaluate.limit, cfg.model.path)
    assert got == (1e-3, 4, 0, "models/x")
    assert cfg.cost.per_call == {"track": 0.05, "commit": 0.02, "recall": 0.03, "note": 0.03}  # merged, not replaced
    assert cfg.registered_model_name == "other" and cfg.sft.time_budget_s == 5400  # the rest is the profile's
    with pytest.raises(ValueError, match="SECTION.FIELD=VALUE"):
        parse_overrides(["learning_rate=1e-3"])
    with pytest.raises(ValueError, match="sft.max_steps is 'many'"):
        load_profile("full", parse_overrides(["sft.max_steps=many"]))
    with pytest.raises(ValueError, match="unknown fields \\['lr'\\]"):
        load_profile("full", parse_overrides(["sft.lr=1"]))
