"""Three speed-ups of TextWorld 1.7.0's PDDL environment (ALFWorld's engine) that leave every episode unchanged.

Collection spends most of its time inside TextWorld, not in the expert (py-spy on one collection worker, 2026-12-02):

1. **The first ``reset`` reuses ``load``'s state.** ``PddlEnv.load`` builds the game's ``PddlState`` (two
   fast-downward translations of the PDDL problem) only to read the entity names, and ``PddlEnv.reset`` builds it
   again from the same inputs (57 % of a worker's time was in ``reset``). The patched ``reset`` hands the untouched
   state from ``load`` to its first call; every later ``reset`` of the same game builds a fresh one as shipped.
   The hand-over goes through a thread-local slot, never a swapped module global.
2. **Each grammar and logic expression is parsed once per process.** ``ContextSensitiveGrammar.derive`` parses the
   same command templates and feedback rules with tatsu at every step, and ``Rule.parse_conjunctive_query`` the
   same rule conditions (25 % and 11 % of a worker's time with 1. in place). The patched
   ``textworld.envs.pddl.textgen._parse_and_convert`` and ``textworld.logic._parse_and_convert`` keep the parse per
   (text, rule) in a bounded LRU cache and return a deep copy, so callers may mutate what they get as before.

3. **The re-planning translation waits for a re-plan.** ``PddlState.__init__`` translates the problem to SAS twice
   with fast-downward's ``pddl2sas``: once for the state, once optimized for ``replan`` (which TextWorld calls only
   for the ``policy_commands`` and ``walkthrough`` infos; ALFWorld's handcoded expert asks for neither). The second
   translation was half of a worker's time with 1. and 2. in place (py-spy, 2026-12-03). The patched state defers
   it: the library copy's ``load_sas_replan`` (which only stores the SAS text for ``replan``) records which
   problem the latest state would have loaded, and the first ``replan`` afterwards translates and loads exactly
   that one, so a re-plan sees what it would have seen as shipped.

Measured on the ``default`` profile's 60 train games (``scripts/recollect.py``, 2 workers, 2026-12-02): 247 and 230 s
as shipped, 178 and 183 s with 1., 90 s with both, byte-identical logs each time; 1,508 of ``data-full``'s 3,553
episodes were collected with both and the whole came out as the md5 ``data-full.dvc`` names.

Both patch TextWorld internals, so ``install`` applies them only to the version they were written and checked
against (``TEXTWORLD_VERSION``) and leaves any other version as shipped. Set ``EVOHARNESS_TEXTWORLD_SPEEDUPS=0`` to
play as shipped (e.g. to check that a result does not depend on them). ``evoharness.env.alfworld.ALFWorldEnv``
installs them, so collection, DAgger, rollouts and evaluation all use them.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import threading
from collections import OrderedDict

TEXTWORLD_VERSION = "1.7.0"
ENV_VAR = "EVOHARNESS_TEXTWORLD_SPEEDUPS"
PARSE_CACHE_SIZE = 4096
_PARSERS = ("textworld.envs.pddl.textgen", "textworld.logic")

_originals: dict[tuple[object, str], object] = {}
_stats = {"state_reused": 0, "parse_hits": 0, "parse_misses": 0, "replan_translations_deferred": 0,
          "replan_translations_done": 0}
_handoff = threading.local()  # the state a patched reset hands to its own PddlState(...) call, in its own thread
_MISSING = object()


def enabled() -> bool:
    """False when ``$EVOHARNESS_TEXTWORLD_SPEEDUPS`` is ``0``, ``false``, ``no`` or ``off``; true otherwise."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def installed() -> bool:
    """Whether the patches are in place in this process."""
    return bool(_originals)


def stats() -> dict[str, int]:
    """Counters since this process started: ``state_reused`` (first resets served by ``load``'s state),
    ``parse_hits`` and ``parse_misses`` of the parse caches."""
    return dict(_stats)


def install() -> bool:
    """Apply the three speed-ups to this process, once (later calls do nothing); returns whether they are in place.

    Does nothing (returns False) when ``enabled()`` is false or the installed TextWorld is not ``TEXTWORLD_VERSION``.
    Raises ImportError when TextWorld's PDDL environment cannot be imported (fast-downward missing)."""
    if _originals:
        return True
    import textworld

    if not enabled() or textworld.__version__ != TEXTWORLD_VERSION:
        return False
    import textworld.envs.pddl.pddl as pddl

    env_cls = pddl.PddlEnv
    _patch(pddl.pddl_logic, "PddlState", _state_factory(pddl.pddl_logic.PddlState))
    _patch(pddl.pddl_logic.fast_downward, "pddl2sas", _deferred_replan_sas(pddl.pddl_logic.fast_downward.pddl2sas))
    _patch(env_cls, "load", _load(env_cls.load))
    _patch(env_cls, "reset", _reset(env_cls.reset))
    for name in _PARSERS:
        module = sys.modules.get(name) or __import__(name, fromlist=["_parse_and_convert"])
        _patch(module, "_parse_and_convert", _memoized(module._parse_and_convert))
    return True


def uninstall() -> None:
    """Restore TextWorld as shipped in this process (tests compare both ways in one process)."""
    for (owner, attr), original in _originals.items():
        setattr(owner, attr, original)
    _originals.clear()


def _patch(owner, attr: str, replacement) -> None:
    _originals[(owner, attr)] = getattr(owner, attr)
    setattr(owner, attr, replacement)


def _state_factory(state_cls):
    """``PddlState(...)`` as ``pddl.py`` calls it: the state a patched ``reset`` handed over in this thread, once,
    else a new one. Thread-local, so a reset abandoned in a timed-out thread (``evoharness.env.timeouts``) cannot hand
    its state to another thread's ``load``."""

    @functools.wraps(state_cls, updated=())
    def PddlState(*args, **kwargs):  # noqa: N802 - stands in for the class
        state = getattr(_handoff, "state", None)
        if state is not None:
            _handoff.state = None
            return state
        downward_lib = args[0] if args else kwargs.get("downward_lib")
        _defer_replan_loads(downward_lib)
        _handoff.defer_replan = True  # read by the patched pddl2sas, in this thread, during this construction only
        try:
            return state_cls(*args, **kwargs)
        finally:
            _handoff.defer_replan = False

    return PddlState


class _ReplanSAS:
    """An optimized SAS translation not made yet: what ``PddlState.__init__`` stores as ``sas_replan`` under 3.
    ``encode`` returns itself, so the shipped ``load_sas_replan(self.sas_replan.encode("utf-8"))`` hands it to the
    library wrapper below, which keeps it until a ``replan``."""

    def __init__(self, translate, domain, problem, verbose):
        self._translate, self._args = translate, (domain, problem, verbose)

    def encode(self, encoding: str = "utf-8"):
        return self

    def materialize(self) -> bytes:
        """Translate now (called once: the library wrapper drops a pending translation once loaded)."""
        domain, problem, verbose = self._args
        _stats["replan_translations_done"] += 1
        return self._translate(domain, problem, verbose=verbose, optimize=True)[1].encode("utf-8")


def _deferred_replan_sas(original):
    """``fast_downward.pddl2sas``: an optimized translation asked for while a patched ``PddlState`` is being built
    in this thread comes back as a ``_ReplanSAS``; every other call runs as shipped."""

    @functools.wraps(original)
    def pddl2sas(domain, problem, verbose=False, optimize=False):
        if optimize and getattr(_handoff, "defer_replan", False):
            _stats["replan_translations_deferred"] += 1
            return None, _ReplanSAS(original, domain, problem, verbose)
        return original(domain, problem, verbose=verbose, optimize=optimize)

    return pddl2sas


def _defer_replan_loads(downward_lib) -> None:
    """Wrap one fast-downward library copy (``fast_downward.load_lib``, one per ``PddlEnv``), once: its
    ``load_sas_replan`` keeps a ``_ReplanSAS`` as the pending one (real text loads at once, as shipped, and clears
    it); its ``replan`` first loads the pending translation, made then. The C library only stores that text for
    ``replan``, so loading it later loads the same text the latest state would have loaded."""
    if downward_lib is None or getattr(downward_lib, "_evoharness_replan_deferred", False):
        return
    load, replan = downward_lib.load_sas_replan, downward_lib.replan
    pending = {"sas": None}

    def load_sas_replan(sas):
        if isinstance(sas, _ReplanSAS):
            pending["sas"] = sas
            return None
        pending["sas"] = None
        return load(sas)

    def replan_now(*args):
        if pending["sas"] is not None:
            load(pending["sas"].materialize())
            pending["sas"] = None
        return replan(*args)

    downward_lib.load_sas_replan = load_sas_replan
    downward_lib.replan = replan_now
    downward_lib._evoharness_replan_deferred = True


def _load(original):
    @functools.wraps(original)
    def load(self, *args, **kwargs):
        self.__dict__.pop("_evoharness_loaded_state", None)  # a load that raises leaves nothing to reuse
        original(self, *args, **kwargs)
        self._evoharness_loaded_state = self._pddl_state

    return load


def _reset(original):
    @functools.wraps(original)
    def reset(self):
        state = self.__dict__.pop("_evoharness_loaded_state", None)
        if state is None or state is not self._pddl_state:
            return original(self)
        _handoff.state = state  # taken by the shipped reset's one PddlState(...) call (pddl.py)
        try:
            result = original(self)
        finally:
            _handoff.state = None
        _stats["state_reused"] += 1
        return result

    return reset


def _memoized(original):
    cache: OrderedDict = OrderedDict()

    @functools.wraps(original)
    def parse_and_convert(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        try:
            parsed = cache.get(key, _MISSING)
        except TypeError:  # an unhashable argument: parse as shipped
            return original(*args, **kwargs)
        if parsed is _MISSING:
            parsed = cache[key] = original(*args, **kwargs)
            _stats["parse_misses"] += 1
            if len(cache) > PARSE_CACHE_SIZE:
                cache.popitem(last=False)
        else:
            _stats["parse_hits"] += 1
        return copy.deepcopy(parsed)

    return parse_and_convert
