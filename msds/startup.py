"""What a starting training process is waiting on, named for the start-up watchdog
(msds.train.guards.StartupWatchdog): each stage of a start that can wait on something outside the
process (a lock file of torch's extension cache, the rendezvous, the collectives of the engine
build and of the first step) runs inside `waiting_on(...)`, and the watchdog, when it fires, names
the innermost one. No imports beyond the standard library: msds.compat uses it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

_waits: list[Callable[[], str]] = []


@contextlib.contextmanager
def waiting_on(what: str | Callable[[], str]):
    """Within it, this process waits on `what` (a text, or a function that says it when asked, e.g.
    with a lock file's age at that moment)."""
    _waits.append(what if callable(what) else (lambda: what))
    try:
        yield
    finally:
        _waits.pop()


def current() -> str:
    """The innermost wait, described now."""
    if not _waits:
        return "nothing msds names (imports, reading the config or data: see the stacks)"
    return _waits[-1]()
