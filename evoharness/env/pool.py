"""ALFWorld environments in child processes, for episodes that play together in one process's threads.

A ``EnvWorker`` is one child process that loads one game at a time (``evoharness.env.alfworld.ALFWorldEnv``) and
answers ``reset``/``step`` over a pipe; ``RemoteEnv`` is the adapter ``run_episode`` steps (same ``reset``, ``step``,
``close``, ``game`` and ``task_type`` as ``ALFWorldEnv``). Keeping each environment in its own process keeps
TextWorld's module-level state out of the threads of the batched policy, and lets the worker be replaced:

* every ``recycle_every`` episodes, against TextWorld's reset leak (about 6 MB an episode measured on
  ``valid_seen``, which a long-lived evaluation process would otherwise accumulate);
* after a call that timed out or a child that died, so a hung or crashed game costs one episode, not the run.

Waiting on the pipe releases the GIL, so the threads' environment steps overlap with the batched forward passes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection


def _child(conn, parent: int) -> None:
    """The worker process: one ``ALFWorldEnv`` at a time, driven by (method, args) messages."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    from evoharness.env.alfworld import ALFWorldEnv

    env = None
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        if os.getppid() != parent:
            return
        try:
            if method == "open":
                if env is not None:
                    env.close()
                env = ALFWorldEnv(*args)
                result = (env.game, env.task_type)
            elif method == "close":
                if env is not None:
                    env.close()
                env, result = None, None
            elif method == "stop":
                if env is not None:
                    env.close()
                conn.send(("ok", None))
                return
            else:
                result = getattr(env, method)(*args)
            conn.send(("ok", result))
        except Exception as exc:  # noqa: BLE001 - the parent raises it in the episode's thread
            try:
                conn.send(("error", exc))
            except Exception:  # noqa: BLE001 - an exception that does not pickle
                conn.send(("error", RuntimeError(repr(exc))))


class EnvWorker:
    """One child process hosting an ALFWorld game at a time (module docstring); not shared between threads.

    ``recycle_every``: episodes before the process is replaced by a fresh one (0: never)."""

    def __init__(self, recycle_every: int = 50):
        self.recycle_every = recycle_every
        self.episodes = 0
        self.restarts = 0
        self._proc = None
        self._conn = None
        self._busy = False
        self._lock = threading.Lock()

    def _start(self) -> None:
        # a fresh interpreter, not a fork (the parent holds threads and torch, whose locks a fork would copy
        # mid-use) and not multiprocessing's spawn (which re-runs the parent's __main__ script in the child)
        mine, theirs = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, "-m", "evoharness.env.pool", str(theirs.fileno()),
                                       str(os.getpid())], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(mine.detach())

    def call(self, method: str, *args):
        """Run ``method(*args)`` on the hosted environment and return its result; its exception is raised here.
        Raises RuntimeError when the child process dies during the call."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            self._busy = True
            proc = self._proc
            try:
                self._conn.send((method, args))
                status, value = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError) as exc:
                if self._proc is proc:  # not already replaced after a timeout
                    self._kill()
                raise RuntimeError(f"the environment process died during {method}: {exc!r}; it is restarted for "
                                   "the next episode") from None
            self._busy = False
        if status == "error":
            raise value
        return value

    def release(self) -> None:
        """The episode has ended: close its game; replace the process when it hung, or after ``recycle_every``
        episodes."""
        self.episodes += 1
        if self._busy:  # a call that never returned (timed out): the process cannot be trusted
            self._kill()
            return
        if self.recycle_every and self.episodes % self.recycle_every == 0:
            self.stop()
            self.restarts += 1
            return
        try:
            self.call("close")
        except Exception:  # noqa: BLE001 - a game that fails to close is dropped with its process
            self._kill()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5)
        self._proc, self._conn, self._busy = None, None, False
        self.restarts += 1

    def stop(self) -> None:
        """End the child process (it closes its game first)."""
        if self._proc is None:
            return
        try:
            with self._lock:
                self._conn.send(("stop", ()))
                self._conn.recv()
            self._proc.wait(10)
        except Exception:  # noqa: BLE001 - a dead or hung child is killed instead
            pass
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5)
        self._conn.close()
        self._proc, self._conn = None, None

    def rss_mb(self) -> float:
        """The child's resident memory in MB (0 when it is not running)."""
        if self._proc is None or self._proc.poll() is not None:
            return 0.0
        try:
            with open(f"/proc/{self._proc.pid}/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except OSError:
            return 0.0


class RemoteEnv:
    """The ``ALFWorldEnv`` adapter of one game, hosted by ``worker`` (same constructor arguments after it).

    Raises what ``ALFWorldEnv`` raises when the game cannot be loaded."""

    def __init__(self, worker: EnvWorker, game: str, max_steps: int = 50, expert: bool = True,
                 data_dir: str | None = None):
        self.worker = worker
        self.game, self.task_type = worker.call("open", game, max_steps, expert, data_dir)

    def reset(self, seed: int = 0):
        return self.worker.call("reset", seed)

    def step(self, action: str):
        return self.worker.call("step", action)

    def close(self) -> None:
        self.worker.release()


if __name__ == "__main__":  # an EnvWorker's child: python -m evoharness.env.pool FD PARENT_PID
    _child(Connection(int(sys.argv[1])), int(sys.argv[2]))
