"""Faults reproduced for real with cheap real parts (issue 39): a killed process's MLflow run, two writers of one
stage folder, a killed launcher or ``accelerate launch``, a corrupt shard, a profile typo."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import git, make_git_repo
from evoharness.faults import (
    HOST_TAG,
    KILLED_REASON_TAG,
    LOCK_NAME,
    PID_TAG,
    START_TAG,
    FolderBusy,
    start_time,
    writer_lock,
)

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def wait_until(check, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def alive(pid: int) -> bool:
    return start_time(pid) is not None  # a zombie counts as gone


@pytest.fixture
def spawned():
    """Processes a test starts: whatever is left of them is killed at the end, even when the test fails."""
    procs: list = []
    pids: list[int] = []
    yield procs, pids
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def kill9(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL


# --- item 1: no MLflow run stays RUNNING after its process dies ----------------------------------------------------


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A real MLflow sqlite store in ``tmp_path/mlflow`` (``evoharness.registry.tracking.configure``), as the stages
    use."""
    import mlflow

    from evoharness.registry.tracking import configure

    before = mlflow.get_tracking_uri()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    configure(tmp_path)
    yield tmp_path
    while mlflow.active_run():
        mlflow.end_run()
    mlflow.set_tracking_uri(before)


STARTER = """
    import sys, time
    from evoharness.registry.tracking import configure, start_run
    configure(sys.argv[1])
    with start_run("pipeline") as parent:
        with start_run("sft", parent.info.run_id) as child:
            print(parent.info.run_id, child.info.run_id, flush=True)
            time.sleep(300)
"""


def start_runs(procs, repo) -> tuple[subprocess.Popen, str, str]:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(STARTER), str(repo)], env=ENV,
                         stdout=subprocess.PIPE, text=True)
    procs.append(p)
    parent_id, child_id = p.stdout.readline().split()
    return p, parent_id, child_id


def test_each_repository_gets_its_own_store_in_one_process(tmp_path, monkeypatch):
    """MLflow writes MLFLOW_TRACKING_URI into os.environ; the next repository must still get its own store."""
    import mlflow

    from evoharness.registry import tracking

    monkeypatch.setattr(tracking, "USER_TRACKING_URI", None)
    before = mlflow.get_tracking_uri()
    try:
        first = tracking.configure(tmp_path / "a")
        assert os.environ["MLFLOW_TRACKING_URI"] == first  # what MLflow does: the trap this guards against
        second = tracking.configure(tmp_path / "b")
        assert second == f"sqlite:///{(tmp_path / 'b' / 'mlflow' / 'mlflow.db').resolve()}"
        assert mlflow.get_tracking_uri() == second
        monkeypatch.setattr(tracking, "USER_TRACKING_URI", "sqlite:///" + str(tmp_path / "user.db"))
        assert tracking.configure(tmp_path / "c") == "sqlite:///" + str(tmp_path / "user.db")  # the user's choice
    finally:
        mlflow.set_tracking_uri(before)


def test_runs_of_a_killed_process_are_closed_as_killed_when_the_flow_starts_again(store, spawned, caplog):
    from mlflow import MlflowClient

    from evoharness.registry.tracking import start_run

    procs, _ = spawned
    client = MlflowClient()
    killed, killed_parent, killed_sft = start_runs(procs, store)
    live, live_parent, live_sft = start_runs(procs, store)
    run = client.get_run(killed_parent)
    assert run.info.status == "RUNNING"
    assert run.data.tags[PID_TAG] == str(killed.pid) and run.data.tags[HOST_TAG] == socket.gethostname()
    assert run.data.tags[START_TAG] == start_time(killed.pid)
    kill9(killed)
    # a run of the same kind started elsewhere: its process cannot be checked from here
    exp = run.info.experiment_id
    remote = client.create_run(exp, run_name="pipeline", tags={PID_TAG: "1", HOST_TAG: "gpu-node-7", START_TAG: "5"})
    assert client.get_run(killed_sft).info.status == "RUNNING"  # the fault: left RUNNING for good

    with start_run("pipeline") as new:
        assert new.data.tags[PID_TAG] == str(os.getpid())
    for run_id in (killed_parent, killed_sft):  # the killed flow's run and its stage run
        run = client.get_run(run_id)
        assert run.info.status == "KILLED" and run.info.end_time is not None
        assert f"process {killed.pid} on {socket.gethostname()}" in run.data.tags[KILLED_REASON_TAG]
        assert new.info.run_id in run.data.tags[KILLED_REASON_TAG]
    for run_id in (live_parent, live_sft):  # a live flow's runs are left alone
        assert client.get_run(run_id).info.status == "RUNNING"
    assert client.get_run(remote.info.run_id).info.status == "RUNNING"
    assert any(remote.info.run_id in r.message and "not this host" in r.message for r in caplog.records)
    assert client.get_run(new.info.run_id).info.status == "FINISHED"


def test_a_run_whose_pid_now_names_another_process_is_closed(store):
    """Same PID, other start time: the process that started the run is gone and its PID was given again."""
    import mlflow
    from mlflow import MlflowClient

    from evoharness.registry.tracking import start_run

    client = MlflowClient()
    exp = mlflow.get_experiment_by_name("evoharness").experiment_id
    me = {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()}
    reused = client.create_run(exp, run_name="ingest", tags={**me, START_TAG: "1"})
    mine = client.create_run(exp, run_name="ingest", tags={**me, START_TAG: start_time(os.getpid())})
    with start_run("ingest"):
        pass
    run = client.get_run(reused.info.run_id)
    assert run.info.status == "KILLED"
    assert "its PID now belongs to another process" in run.data.tags[KILLED_REASON_TAG]
    assert client.get_run(mine.info.run_id).info.status == "RUNNING"  # this very process: alive


# --- item 2: one writer per stage folder -----------------------------------------------------------------------------


HOLDER = """
    import sys, time
    from evoharness.faults import writer_lock
    with writer_lock(sys.argv[1], what="evoharness.training.sft"):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
"""


def hold(procs, folder, seconds: float = 300) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(folder), str(seconds)], env=ENV,
                         stdout=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_live_writer_is_named_and_a_second_launch_starts_nothing(tmp_path, spawned):
    from evoharness.training.launch import accelerate_launch

    procs, _ = spawned
    folder = tmp_path / "sft" / "key"
    holder = hold(procs, folder)
    lock = json.loads((folder / LOCK_NAME).read_text())
    with pytest.raises(FolderBusy) as err:
        with writer_lock(folder, wait_s=0):
            pytest.fail("a second writer got the folder")
    message = str(err.value)
    host = socket.gethostname()
    assert f"{folder} is being written by PID {holder.pid} on host {host} (evoharness.training.sft)" in message
    assert f"since {lock['since']}" in message and f"kill {holder.pid}" in message
    with pytest.raises(FolderBusy, match=f"PID {holder.pid}"):  # a retried stage: refused before anything starts
        accelerate_launch("evoharness.training.sft", {"a": 1}, folder)
    assert not (folder / "spec.json").exists()
    assert json.loads((folder / LOCK_NAME).read_text())["pid"] == str(holder.pid)  # still the live writer's


def test_the_lock_of_a_killed_writer_is_taken_over(tmp_path, spawned, caplog):
    procs, _ = spawned
    holder = hold(procs, tmp_path)
    kill9(holder)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == str(holder.pid)  # left behind by the kill
    with writer_lock(tmp_path, wait_s=0):
        lock = json.loads((tmp_path / LOCK_NAME).read_text())
        assert (lock["pid"], lock["host"], lock["start_time"]) == (str(os.getpid()), socket.gethostname(),
                                                                   start_time(os.getpid()))
    assert any(f"taking over the lock of PID {holder.pid}" in r.message for r in caplog.records)
    assert not (tmp_path / LOCK_NAME).exists()  # released


def test_a_reused_pid_does_not_hold_the_lock(tmp_path):
    """The lock names a live PID (this one) with another start time: its writer is gone, the PID was reused."""
    stale = {"pid": str(os.getpid()), "host": socket.gethostname(), "start_time": "1", "since": "then"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
    with writer_lock(tmp_path, wait_s=0):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["start_time"] == start_time(os.getpid())


def test_the_holder_may_take_its_own_lock_again(tmp_path):
    """A stage that locks its folder around ``accelerate_launch`` (which locks it too) is not refused by itself."""
    with writer_lock(tmp_path, wait_s=0, what="sft stage"):
        with writer_lock(tmp_path, wait_s=0, what="evoharness.training.sft") as inner:
            inner.add_child(os.getppid())
        lock = json.loads((tmp_path / LOCK_NAME).read_text())
        assert lock["what"] == "sft stage" and lock["child_pid"] == str(os.getppid())  # kept by the inner exit
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_launch_asked_to_wait_gets_the_folder_when_the_writer_ends(tmp_path, spawned):
    procs, _ = spawned
    holder = hold(procs, tmp_path, seconds=1.5)
    t = time.monotonic()
    with writer_lock(tmp_path, wait_s=60, poll_s=0.1):
        assert 1.0 < time.monotonic() - t < 30  # it waited for the writer's 1.5 s
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == str(os.getpid())
    assert holder.wait(timeout=30) == 0  # the writer was let finish, not stopped


# --- item 2: the launcher's children die with it -------------------------------------------------------------------


LAUNCHER = """
    import sys
    from evoharness.training.launch import run_as_group
    print("exit", run_as_group([sys.executable, "-c", sys.argv[1]]), flush=True)
"""
# stands in for `accelerate launch`: starts one trainer through the wrapper, as accelerate_launch has it do, and one
# process without it (a helper that only the group stop reaches)
MIDDLE = """
import os, pathlib, subprocess, sys
d = pathlib.Path({folder!r})
sleeper = "import os, pathlib, time; pathlib.Path(%r).write_text(str(os.getpid())); time.sleep(300)"
subprocess.Popen([sys.executable, "-c", sleeper % str(d / "plain")])
(d / "middle").write_text(str(os.getpid()))
subprocess.run([sys.executable, "-m", "evoharness.training.launch", sys.executable, "-c", sleeper % str(d / "trainer")])
"""


def start_launcher(procs, pids, folder) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LAUNCHER), MIDDLE.format(folder=str(folder))],
                         env=ENV, stdout=subprocess.PIPE, text=True)
    procs.append(p)
    names = ("middle", "trainer", "plain")
    wait_until(lambda: all((folder / n).exists() and (folder / n).read_text() for n in names), what="the group")
    found = {n: int((folder / n).read_text()) for n in names}
    pids.extend(found.values())
    assert all(alive(pid) for pid in found.values())
    assert os.getpgid(found["trainer"]) == os.getpgid(found["plain"]) == found["middle"] != os.getpgid(0)
    return p, found


def test_killing_the_launcher_leaves_no_trainer(tmp_path, spawned):
    procs, pids = spawned
    launcher, found = start_launcher(procs, pids, tmp_path)
    kill9(launcher)
    wait_until(lambda: not alive(found["middle"]) and not alive(found["trainer"]), timeout=20,
               what="the launched process and its trainer to die with the launcher")
    os.kill(found["plain"], signal.SIGKILL)  # not started through the wrapper: only a live launcher stops it


def test_killing_accelerate_launch_leaves_no_orphan(tmp_path, spawned):
    """The issue's case: kill -9 of the `accelerate launch` process orphaned the trainer, which kept writing."""
    procs, pids = spawned
    launcher, found = start_launcher(procs, pids, tmp_path)
    os.kill(found["middle"], signal.SIGKILL)
    wait_until(lambda: not any(alive(pid) for pid in found.values()), timeout=20, what="every process of the group")
    assert launcher.stdout.readline().split() == ["exit", str(-signal.SIGKILL)]
    assert launcher.wait(timeout=30) == 0


PROBE = """
import ctypes, json, os, sys
from pathlib import Path

spec = json.loads(Path(sys.argv[sys.argv.index("--spec") + 1]).read_text())
sig = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
out = Path(spec["output_dir"])
lock = json.loads((out / ".writer.lock").read_text())
(out / "result.json").write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0),
                                             "pdeathsig": sig.value, "lock": lock}))
"""


def test_accelerate_launch_starts_the_trainer_as_one_writer_that_dies_with_it(tmp_path):
    """The real `accelerate launch` (one CPU process) on a probe module: the trainer has the parent-death signal
    armed, its parent leads the trainers' process group, and the lock names the launcher and that group."""
    from evoharness.training.launch import accelerate_launch

    (tmp_path / "faultprobe.py").write_text(PROBE)
    out = tmp_path / "out"
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    result = accelerate_launch("faultprobe", {"output_dir": str(out)}, out, 1, env)
    assert result["pdeathsig"] == signal.SIGTERM
    assert result["pgid"] == result["ppid"] != os.getpgid(0)  # `accelerate launch` leads a group of its own
    assert result["lock"]["pid"] == str(os.getpid()) and result["lock"]["child_pid"] == str(result["ppid"])
    assert not alive(result["ppid"]) and not alive(result["pid"])
    assert not (out / LOCK_NAME).exists()


# --- item 4: messages say what to do ---------------------------------------------------------------------------------


def episode(n: int) -> list[dict]:
    base = {"game": f"train/g{n}/game.tw-pddl", "task_type": "pick_and_place_simple", "episode_id": f"e{n}",
            "admissible_commands": ["go to desk 1"], "perturbed": False}
    return [{**base, "step": 0, "observation": "You are in a room. Your task is to: put a pen on desk.",
             "action": None, "action_source": None, "reward": 0.0, "done": False, "won": False},
            {**base, "step": 1, "observation": "You arrive at desk 1.", "action": "go to desk 1",
             "action_source": "expert", "reward": 1.0, "done": True, "won": True}]


def test_a_corrupt_record_says_what_to_do_and_each_remedy_works(tmp_path):
    from evoharness.data.datastore import dvc_add, ensure_dvc_repo
    from evoharness.data.rawlog import RawLogError, read_episodes

    repo = make_git_repo(tmp_path / "repo")
    ensure_dvc_repo(repo)
    shard = repo / "data" / "logs" / "shard-00000.jsonl"
    shard.parent.mkdir(parents=True)
    good = [json.dumps(r) for r in episode(1) + episode(2)]
    shard.write_text("\n".join(good) + "\n")
    md5 = dvc_add(repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "data")
    bad = list(good)
    bad[1] = bad[1].replace('"won": true', '"won": "yes"')
    shard.write_text("\n".join(bad) + "\n")

    with pytest.raises(RawLogError) as err:
        read_episodes(repo)
    message = str(err.value)
    assert message.startswith("data/logs/shard-00000.jsonl:2: field 'won' is str, expected bool. To go on: ")
    assert "fix line 2 of data/logs/shard-00000.jsonl" in message
    assert "`dvc checkout --force data/logs/shard-00000.jsonl`" in message
    assert "`ingest.on_error: quarantine`" in message

    quarantine: list = []  # remedy 3: the bad record's episode is set aside, counted, and the rest read
    episodes, _ = read_episodes(repo, quarantine=quarantine)
    assert [e.episode_id for e in episodes] == ["e2"] and len(quarantine) == 2
    dvc = Path(sys.executable).parent / "dvc"
    subprocess.run([str(dvc), "checkout", "--force", "data/logs/shard-00000.jsonl"], cwd=repo, check=True,
                   capture_output=True)
    episodes, read_md5 = read_episodes(repo)  # remedy 2, as the message spells it
    assert [e.episode_id for e in episodes] == ["e1", "e2"] and read_md5 == md5


def test_the_summary_counts_quarantined_records():
    from evoharness.evaluation.report import EVAL_KEYS, pipeline_summary, print_summary
    from evoharness.harness.workspace import META_ACTIONS

    ev = {k: 0.0 for k in EVAL_KEYS} | {"split": "valid_seen", "success_by_task_type": {}, "episodes_by_task_type": {},
                                        "meta_actions_per_episode": {m: 0.0 for m in META_ACTIONS},
                                        "mlflow_run_id": "r"}
    args = (ev, None, {"model_uri": "models:/m/1"}, None, {}, {"content_hash": "h" * 16},
            {"status": "present", "md5": "abc.dir"}, {"ingest": 1.0}, {}, {"promoted": False, "champion_version": None},
            "p", {})
    s = pipeline_summary(*args, ingest={"on_error": "quarantine", "quarantined_records": 13})
    assert s["ingest"] == {"on_error": "quarantine", "quarantined_records": 13}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        print_summary(s)
    assert ("ingest: 13 bad raw-log records quarantined (ingest.on_error: quarantine), set aside in "
            "runs/quarantine/<md5>.jsonl") in out.getvalue().splitlines()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        print_summary(pipeline_summary(*args))  # stop at the first bad record: nothing quarantined, no line
    assert "quarantined" not in out.getvalue()


def test_a_profile_typo_is_told_at_once_without_a_traceback():
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "flows.pipeline", "--profile", "nosuchprofile"], cwd=REPO, env=ENV,
                       capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t
    assert p.returncode == 2, p.stderr
    assert "error: profile 'nosuchprofile' not found" in p.stderr and "'tiny'" in p.stderr  # the available ones
    assert "Traceback" not in p.stderr and "Prefect" not in p.stdout + p.stderr
    assert took < 15, f"{took:.1f} s: no Prefect server may start before the profile is read"


def test_a_bad_profile_value_is_told_at_once_by_the_evaluate_flow(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("evaluate:\n  workers: 0\n")
    p = subprocess.run([sys.executable, "-m", "flows.evaluate", "--policy", "expert", "--profile", str(bad)],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "error: evaluate.workers is 0; use 1 or more processes" in p.stderr
    assert "Traceback" not in p.stderr
