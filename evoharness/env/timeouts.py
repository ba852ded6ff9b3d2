"""Wall-clock limits for environment calls."""

from __future__ import annotations

import queue
import threading


def call_with_timeout(fn, timeout_s: float, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` and return its result (or raise its exception), or raise TimeoutError after
    ``timeout_s`` seconds.

    The call runs in a daemon thread: a call that hangs is abandoned (a thread cannot be killed) and does not keep
    the process alive at exit; callers end the episode and replace the environment.
    """
    if not timeout_s or timeout_s <= 0:
        return fn(*args, **kwargs)
    box: queue.Queue = queue.Queue(maxsize=1)

    def run():
        try:
            box.put((True, fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.put((False, exc))

    threading.Thread(target=run, daemon=True, name=f"env-call-{getattr(fn, '__name__', 'fn')}").start()
    try:
        ok, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"{getattr(fn, '__qualname__', fn)} did not return within {timeout_s}s") from None
    if ok:
        return value
    raise value
