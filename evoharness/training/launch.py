"""Run a training entry point under ``accelerate launch`` in a child process (as TRL's docs launch trainers), as the
one writer of its folder, with no process outliving the launch.

How no trainer outlives its launcher (Linux):

- ``accelerate launch`` starts in its own session and process group (``start_new_session``), through this module's
  ``__main__`` (``python -m evoharness.training.launch PROGRAM ARGS...``): it arms the parent-death signal
  (``prctl(PR_SET_PDEATHSIG, SIGTERM)`` through ctypes) and then execs PROGRAM under the same PID. So when the
  launcher dies, even by ``kill -9``, ``accelerate launch`` gets SIGTERM.
- The trainers are started by ``accelerate launch`` through the same wrapper (``-m evoharness.training.launch python -m
  MODULE``), so they get SIGTERM when ``accelerate launch`` dies, however it dies. This matters: torch's elastic
  launcher (two processes) puts each trainer in a session of its own, out of reach of the group.
- When ``accelerate launch`` ends, or the launcher's wait is interrupted (Ctrl-C, or an exception a timeout raises in
  the launcher's thread), every process left in its group gets SIGTERM, then SIGKILL after a grace period
  (``stop_group``). Killing ``accelerate launch`` alone thus stops what it started, whether or not it was wrapped.

The signal is armed *after* exec rather than in a ``preexec_fn``, which is unsafe in a process with threads (Prefect
runs tasks in threads); the wrapper checks that its parent is still the one that started it, so a parent that died
before the signal was armed is caught too. The kernel sends the parent-death signal when the *thread* that started
the child ends: ``run_as_group`` starts and waits for the child in the same thread.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from evoharness.faults import writer_lock

ACCELERATE_DIR = Path(__file__).resolve().parents[2] / "accelerate"
PARENT_ENV = "EVOHARNESS_PARENT_PID"  # the PID the wrapped process must have as parent when it arms the signal
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def accelerate_config(num_processes: int) -> Path:
    """The repo's Accelerate config for 1 or 2 CPU processes (``accelerate/cpu_{n}proc.yaml``)."""
    path = ACCELERATE_DIR / f"cpu_{num_processes}proc.yaml"
    if not path.exists():
        raise FileNotFoundError(f"no Accelerate config for {num_processes} CPU processes: {path}")
    return path


def accelerate_launch(module: str, spec: dict, workdir: str | Path, num_processes: int = 1,
                      env: dict | None = None, config_file: str | Path | None = None,
                      wait_s: float | None = None) -> dict:
    """Write ``spec`` to ``workdir/spec.json``, run ``accelerate launch -m module --spec ...``, return its
    ``workdir/result.json``. Output streams to this process's stdout (progress bars included).

    ``config_file``: an Accelerate config (relative paths from the repo root, e.g. ``accelerate/fsdp_gpu.yaml``);
    default: the repo's CPU config for ``num_processes``.

    One writer per folder: the launch holds ``workdir/.writer.lock`` (``evoharness.faults.writer_lock``) from before
    ``spec.json`` is written until every process it started is gone; a lock left by a dead launch is taken over.
    ``wait_s``: how long to wait for a live writer of ``workdir`` (default: ``EVOHARNESS_LOCK_WAIT_S``, else 0).
    The trainers die with the launch (see the module docstring).

    Raises FolderBusy (before starting anything) when a live process writes ``workdir``; RuntimeError with the exit
    code and the command when the child fails; FileNotFoundError for a missing Accelerate config.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if config_file:
        config = Path(config_file) if Path(config_file).is_absolute() else ACCELERATE_DIR.parent / config_file
        if not config.exists():
            raise FileNotFoundError(f"Accelerate config {config} not found (sft.accelerate_config or "
                                    "grpo.accelerate_config)")
    else:
        config = accelerate_config(num_processes)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--num_processes", str(num_processes),  # the stage config's count wins over the file's
           "-m", "evoharness.training.launch", sys.executable, "-m", module, "--spec", str(workdir / "spec.json")]
    child_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                 "PYTHONPATH": os.pathsep.join([str(ACCELERATE_DIR.parent), os.environ.get("PYTHONPATH", "")]),
                 **(env or {})}
    with writer_lock(workdir, wait_s=wait_s, what=module) as lock:
        (workdir / "spec.json").write_text(json.dumps(spec, indent=1))
        code = run_as_group(cmd, child_env, on_start=lock.add_child)
    if code != 0:
        raise RuntimeError(f"{module} failed with exit code {code}: {' '.join(cmd)}; its checkpoints in "
                           f"{workdir} let a re-run resume")
    return json.loads((workdir / "result.json").read_text())


def run_as_group(cmd: list[str], env: dict | None = None, on_start=None, grace_s: float = 10.0) -> int:
    """Run ``cmd`` as the leader of a new session and process group that dies with this process; wait for it and
    return its exit code (negative: the signal that killed it).

    ``cmd`` runs through ``python -m evoharness.training.launch`` (the parent-death signal, then exec).
    ``on_start(pid)``
    is called once it started (``WriterLock.add_child``). Whether ``cmd`` ends or the wait is interrupted, the
    processes left in its group are stopped (``stop_group``) before this returns or re-raises.
    """
    env = dict(os.environ if env is None else env)
    root = str(ACCELERATE_DIR.parent)  # the wrapper is this module: importable wherever the child starts
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env[PARENT_ENV] = str(os.getpid())
    proc = subprocess.Popen([sys.executable, "-m", "evoharness.training.launch", *cmd], env=env, start_new_session=True)
    try:
        if on_start is not None:
            on_start(proc.pid)
        while True:
            try:  # waits in Python, not in one blocking call: an exception sent to this thread gets through
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                continue
    finally:
        stop_group(proc.pid, grace_s, leader=proc)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, read from ``/proc``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # it ended while we looked
        fields = text[text.rindex(")") + 2:].split()  # fields[0] is field 3 (state), fields[2] field 5 (pgrp)
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def stop_group(pgid: int, grace_s: float = 10.0, leader: subprocess.Popen | None = None) -> None:
    """SIGTERM every process in process group ``pgid``, SIGKILL those left after ``grace_s``; return once none is
    left alive (or right after the SIGKILL). ``leader``: our child that leads the group, reaped as it ends (a zombie
    is in the group until reaped). An empty group is left as it is."""
    sig, deadline = signal.SIGTERM, time.monotonic() + grace_s
    while True:
        if leader is not None:
            leader.poll()
        if sig == 0 and Path("/proc/self/stat").exists() and not group_members(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):  # no process left (or the id is another user's now)
            break
        if sig == signal.SIGKILL:
            break
        time.sleep(0.05)
        sig = signal.SIGKILL if time.monotonic() >= deadline else 0
    if leader is not None and leader.poll() is None:
        leader.wait()


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) ends: ``prctl(PR_SET_PDEATHSIG)``.
    Kept across exec. Returns False where there is no such call (not Linux).

    Raises OSError when prctl refuses."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    return True


def main(argv: list[str]) -> None:
    """``python -m evoharness.training.launch PROGRAM ARGS...``: arm the parent-death signal, check the parent is still
    the one in ``EVOHARNESS_PARENT_PID`` (when set), name this process as the parent its own wrapped children must
    have, and exec PROGRAM (same PID, so the signal and the name hold for it). Exits 1 when the parent is already
    gone, 2 without a PROGRAM."""
    if not argv:
        print("usage: python -m evoharness.training.launch PROGRAM [ARGS...]", file=sys.stderr)
        sys.exit(2)
    expected = os.environ.get(PARENT_ENV)
    die_with_parent(signal.SIGTERM)
    if expected and os.getppid() != int(expected):  # the parent died before the signal was armed
        print(f"evoharness.training.launch: parent {expected} is gone; not starting {argv[0]}", file=sys.stderr)
        sys.exit(1)
    os.environ[PARENT_ENV] = str(os.getpid())
    # torchrun starts workers with `python -u` (stdout written through): the exec'd trainer keeps unbuffered output
    if getattr(sys.stdout, "write_through", False):
        os.environ["PYTHONUNBUFFERED"] = "1"
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
