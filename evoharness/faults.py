"""Faults that must leave a trace: MLflow runs left RUNNING by a dead process, and two writers in one stage folder.

A process is named by its PID, its host and its start time: the kernel's ``starttime`` of that PID (field 22 of
``/proc/<pid>/stat``, clock ticks since boot). A PID alone is not enough: once a process dies its PID can be given to
another one, which then has another start time. A process on this host is *gone* when no live process has its PID,
or the one that has it started at another time. A process on another host cannot be checked from here: it is always
treated as alive, and said so.

- Every MLflow run the project starts (``evoharness.registry.tracking.start_run``) carries ``process.pid``,
``process.host``
  and ``process.start_time``. ``close_dead_runs`` closes as KILLED, with a ``killed_reason`` tag, the runs of one
  name left RUNNING by a gone process (a ``kill -9``, the OOM killer, a reboot), and their RUNNING child runs.
- ``writer_lock`` holds ``<folder>/.writer.lock`` (PID, host, start time, since when) while a trainer writes a stage
  folder; a second launch on the folder stops with ``FolderBusy`` naming the holder, or waits when asked; a lock
  whose holder is gone is taken over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger(__name__)

PID_TAG, HOST_TAG, START_TAG = "process.pid", "process.host", "process.start_time"
KILLED_REASON_TAG = "killed_reason"
LOCK_NAME = ".writer.lock"
WAIT_ENV = "EVOHARNESS_LOCK_WAIT_S"  # seconds a launch waits for a live writer of its folder (default 0: stop)


def start_time(pid: int) -> str | None:
    """The kernel start time of ``pid`` (``/proc/<pid>/stat`` field 22, clock ticks since boot), or None when no
    live process has that PID (a zombie counts as dead: it runs no code and holds nothing)."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # field 2, the command name, may hold spaces and ')'
    return None if fields[0] in ("Z", "X") else fields[19]  # fields[0] is field 3 (state)


def this_process(pid: int | None = None) -> dict:
    """``{"pid", "host", "start_time"}`` (strings) of ``pid`` on this host, by default this process."""
    pid = os.getpid() if pid is None else int(pid)
    return {"pid": str(pid), "host": socket.gethostname(), "start_time": start_time(pid) or ""}


def process_tags() -> dict:
    """The MLflow tags naming this process (``process.pid``, ``process.host``, ``process.start_time``)."""
    me = this_process()
    return {PID_TAG: me["pid"], HOST_TAG: me["host"], START_TAG: me["start_time"]}


def is_gone(pid: str | int, host: str, started: str = "") -> bool:
    """Whether the process ``pid`` on ``host`` that started at ``started`` (``start_time``; "" when not recorded) is
    certainly gone: it ran on this host and no live process has its PID, or the live one started at another time
    (the PID was reused). False for a process on another host: it cannot be checked from here. Where ``/proc`` is
    missing (not Linux) nothing is ever gone: a live writer is never taken for a dead one."""
    if host != socket.gethostname() or not Path("/proc/self/stat").exists():
        return False
    now = start_time(int(pid))
    return now is None or (bool(started) and now != str(started))


# --- MLflow runs left RUNNING ------------------------------------------------------------------------------------


def close_dead_runs(name: str, experiment_id: str, closer: str = "", client=None) -> list[str]:
    """Close as KILLED the runs named ``name`` in ``experiment_id`` that are still RUNNING though the process that
    started them is gone (``is_gone`` on their ``process.*`` tags), and the RUNNING runs nested under those whose
    process is gone too. Each gets a ``killed_reason`` tag naming the process and ``closer`` (the run that found it).

    Left alone, each with a warning saying why and how to close it by hand: runs started on another host (their
    process cannot be checked from here) and runs that carry no ``process.pid`` (started before runs recorded their
    process). Runs whose process lives (a concurrent stage, this process's own runs) are left alone silently.

    Returns the ids of the runs closed. Raises what ``MlflowClient`` raises when the store cannot be read or written.
    """
    from mlflow import MlflowClient

    client = client or MlflowClient()
    running = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=5000)
    here = socket.gethostname()
    closed: list[str] = []
    todo = [r for r in running if r.info.run_name == name]
    while todo:
        run = todo.pop()
        tags, run_id = run.data.tags, run.info.run_id
        if run_id in closed or run_id == closer:
            continue
        by_hand = f"MlflowClient().set_terminated('{run_id}', 'KILLED')"
        if PID_TAG not in tags:
            log.warning(f"MLflow run {run_id} ({run.info.run_name}) is RUNNING and records no process (started "
                        f"before runs recorded theirs): left alone; if its process is gone, close it with {by_hand}")
            continue
        pid, host, started = tags[PID_TAG], tags.get(HOST_TAG, ""), tags.get(START_TAG, "")
        if host != here:
            log.warning(f"MLflow run {run_id} ({run.info.run_name}) is RUNNING, started by PID {pid} on host "
                        f"{host!r}, not this host ({here!r}): left alone, since its process cannot be checked from "
                        f"here; if that process is gone, close the run there or with {by_hand}")
            continue
        if not is_gone(pid, host, started):
            continue
        reused = start_time(int(pid)) is not None  # the PID lives, but it is another process now
        reason = (f"process {pid} on {host} (start time {started or 'not recorded'}) is gone"
                  + ("; its PID now belongs to another process" if reused else "")
                  + f"; closed at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}" + (f" by run {closer}" if closer else ""))
        client.set_tag(run_id, KILLED_REASON_TAG, reason)
        client.set_terminated(run_id, status="KILLED")
        closed.append(run_id)
        log.warning(f"MLflow run {run_id} ({run.info.run_name}) was left RUNNING: closed as KILLED ({reason})")
        # its nested stage runs were left RUNNING by the same death; a cached stage would never start to close them
        todo += [r for r in running if r.data.tags.get("mlflow.parentRunId") == run_id]
    return closed


def close_flow_run_runs(flow_run_id: str, reason: str, since_ms: int | None = None, client=None) -> list[str]:
    """Close as KILLED the MLflow runs of a stopped Prefect flow run: those tagged ``prefect_flow_run_id =
    flow_run_id`` (a flow's parent run, ``tasks.run.pipeline_run``) and the runs nested under them, at any depth,
    that are still RUNNING, or that ended FAILED at or after ``since_ms`` (epoch ms: when the stop was asked; a flow
    process ended by a signal fails the runs it holds open). Each gets a ``killed_reason`` tag: ``reason``. Returns
    the ids closed."""
    from mlflow import MlflowClient

    client = client or MlflowClient()
    experiments = [e.experiment_id for e in client.search_experiments()]
    status = "attributes.status = 'RUNNING'" if since_ms is None else "attributes.status != 'FINISHED'"
    runs = client.search_runs(experiments, filter_string=status, max_results=5000)

    def stopped(r) -> bool:
        return r.info.status == "RUNNING" or (since_ms is not None and r.info.status == "FAILED"
                                              and (r.info.end_time or 0) >= since_ms)

    runs = [r for r in runs if stopped(r)]
    todo = [r for r in runs if r.data.tags.get("prefect_flow_run_id") == flow_run_id]
    closed: list[str] = []
    while todo:
        run = todo.pop()
        if run.info.run_id in closed:
            continue
        client.set_tag(run.info.run_id, KILLED_REASON_TAG, reason)
        client.set_terminated(run.info.run_id, status="KILLED")
        closed.append(run.info.run_id)
        todo += [r for r in runs if r.data.tags.get("mlflow.parentRunId") == run.info.run_id]
    return closed


# --- one writer per stage folder ---------------------------------------------------------------------------------


class FolderBusy(RuntimeError):
    """A live process writes the stage folder; the message names it (PID, host, since when), the folder, and what
    to do."""


@contextlib.contextmanager
def _folder_mutex(folder: Path):
    """Serialize the read-check-write of the lock file between processes of this host (``flock`` on the folder):
    two reruns that both find a stale lock must not both take it over."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _read_lock(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: no holder can be checked, so it is stale
    return holder if isinstance(holder, dict) else {}


def _write_lock(path: Path, holder: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(holder, indent=1))
    os.replace(tmp, path)  # atomic: a reader sees the old holder or the new one, never half a file


def holder_is_gone(holder: dict) -> bool:
    """Whether the lock's holder is gone: its process (``pid``) and the process group it launched (``child_pid``,
    the trainers' launcher) are both gone. An empty or unreadable lock has no holder."""
    if not holder.get("pid"):
        return True
    host = holder.get("host", "")
    if not is_gone(holder["pid"], host, holder.get("start_time", "")):
        return False
    return not holder.get("child_pid") or is_gone(holder["child_pid"], host, holder.get("child_start_time", ""))


def busy_message(folder: Path, holder: dict) -> str:
    """What ``FolderBusy`` says: who writes ``folder`` since when, and the ways on."""
    lock = Path(folder) / LOCK_NAME
    child = f", trainers launched as PID {holder['child_pid']}" if holder.get("child_pid") else ""
    what = f" ({holder['what']})" if holder.get("what") else ""
    other = holder.get("host") != socket.gethostname()
    return (f"{folder} is being written by PID {holder.get('pid')} on host {holder.get('host')}{what} since "
            f"{holder.get('since', '?')}{child} (lock {lock}). "
            + (f"That host is not this one ({socket.gethostname()}), so the process cannot be checked from here: if "
               f"it is gone, delete {lock} and rerun. " if other else
               f"Wait for it to finish, or stop it (kill {holder.get('pid')}) and rerun: the lock of a stopped "
               f"writer is taken over. ")
            + f"To wait for it instead of stopping, set {WAIT_ENV}=<seconds>.")


class WriterLock:
    """The held lock (``writer_lock``); ``add_child`` records the process group the holder launched."""

    def __init__(self, folder: Path, holder: dict):
        self.folder, self.path, self.holder = folder, folder / LOCK_NAME, holder

    def add_child(self, pid: int) -> None:
        """Record ``pid`` (the leader of the trainers' process group) in the lock: the lock stays held while it
        lives, even if this process is gone."""
        child = this_process(pid)
        self.holder = {**self.holder, "child_pid": child["pid"], "child_start_time": child["start_time"]}
        with _folder_mutex(self.folder):
            _write_lock(self.path, self.holder)


@contextlib.contextmanager
def writer_lock(folder: str | Path, wait_s: float | None = None, poll_s: float = 2.0, what: str = ""):
    """Hold ``<folder>/.writer.lock`` while the body runs; yields a ``WriterLock``.

    The lock names this process (PID, host, start time), ``since`` (local time) and ``what`` (e.g. the trainer's
    module). A lock whose holder is gone (``holder_is_gone``: a ``kill -9``, a reboot, a reused PID) is taken over
    with a warning. A live holder, or one on another host, makes this wait up to ``wait_s`` seconds (default: the
    ``EVOHARNESS_LOCK_WAIT_S`` environment variable, else 0), checking every ``poll_s``; then it raises
    ``FolderBusy`` naming the holder, the folder and what to do. On exit the lock is removed if it is still ours.
    Re-entrant: taken again by the process that holds it (a stage that locks its folder around ``accelerate_launch``,
    which locks it too), it is kept as it is and left to the outer holder to remove.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    wait_s = float(os.environ.get(WAIT_ENV, "0") or 0) if wait_s is None else wait_s
    me = {**this_process(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "what": what}
    deadline, waiting, ours = time.monotonic() + wait_s, False, False
    while True:
        with _folder_mutex(folder):
            holder = _read_lock(path)
            if holder and all(holder.get(k) == me[k] for k in ("pid", "host", "start_time")):
                ours = True  # held by this process already: the outer holder removes it
                break
            if holder is None or holder_is_gone(holder):
                if holder is not None:
                    log.warning(f"{path}: taking over the lock of PID {holder.get('pid')} on {holder.get('host')} "
                                f"(since {holder.get('since', '?')}), whose process is gone")
                _write_lock(path, me)
                break
        if time.monotonic() >= deadline:
            raise FolderBusy(busy_message(folder, holder))
        if not waiting:
            log.warning(f"waiting up to {wait_s:.0f} s: {busy_message(folder, holder)}")
            waiting = True
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))
    if ours:
        yield WriterLock(folder, holder)
        return
    lock = WriterLock(folder, me)
    try:
        yield lock
    finally:
        with _folder_mutex(folder):
            current = _read_lock(path)
            if current and all(current.get(k) == me[k] for k in ("pid", "host", "start_time")):
                path.unlink()
