"""Wall-clock limits for environment calls."""

from __future__ import annotations

import concurrent.futures


def call_with_timeout(fn, timeout_s: float, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` and return its result, or raise TimeoutError after ``timeout_s`` seconds.

    The call runs in a daemon worker thread; a call that hangs is abandoned (its thread cannot be killed), so
    callers end the episode and replace the environment.
    """
    if not timeout_s or timeout_s <= 0:
        return fn(*args, **kwargs)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(fn, *args, **kwargs).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"{getattr(fn, '__qualname__', fn)} did not return within {timeout_s}s") from None
    finally:
        pool.shutdown(wait=False)
