"""Ctrl-C and SIGTERM for the project's commands: one line, exit ``128 + signal``, no child left behind.

    from verl_ext.interrupt import run_main
    if __name__ == "__main__":
        run_main("quickstart", main)

:func:`run_main` installs handlers for SIGINT and SIGTERM that raise :class:`Interrupted` (a
``KeyboardInterrupt``) in the main thread, so ``finally`` blocks and context managers run as for Ctrl-C.
When the command's ``main`` lets it out, every descendant process still alive is stopped (SIGTERM to
the direct children, then SIGKILL to whatever of the whole tree is left after ``grace`` seconds), one
line ``PROG: interrupted (SIGINT); ...`` goes to stderr, and the process exits with 130 (SIGINT) or
143 (SIGTERM) without the interpreter's teardown. A second signal during that clean-up is ignored.

A command whose own imports are slow calls ``install("prog")`` at the top of its module, before them:
until :func:`run_main` starts ``main``, a signal ends the process at once with the same line.

``stop_children_at_signal=True`` stops the children in the handler itself, before unwinding: a
``ProcessPoolExecutor`` whose ``with`` block is left by the interrupt otherwise waits for every queued
run (``shutdown(wait=True)``); with its workers gone it fails them at once.

A process forked from the command after the handlers were installed (a pool worker) inherits them; there
SIGINT is ignored (the terminal sends Ctrl-C to the whole process group, and the main process stops the
workers) and SIGTERM ends the worker at once, silently.

Only the standard library and ``psutil`` (a verl dependency); nothing in the project is imported.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

_OWNER_PID: int | None = None
_AFTER_STOP: list[Callable[[], object]] = []  # run by interrupted_exit once the children are stopped
_STOP_AT_SIGNAL = False
_PROG: str | None = None  # set by install(prog) before run_main: a signal then exits at once (imports)
_RAISE = False  # run_main is running main: a signal raises Interrupted so finally blocks run
_RECEIVED: int | None = None  # the signal the handler took: a library that turns Interrupted into a plain
# KeyboardInterrupt (Ray's ray.get does) must not make a SIGTERM look like a Ctrl-C


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _ignore_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _handler(signum, frame):  # noqa: ARG001 - the signal module's signature
    if os.getpid() != _OWNER_PID:  # a forked worker (module docstring)
        if signum == signal.SIGTERM:
            os._exit(128 + signum)
        return
    global _RECEIVED
    _RECEIVED = signum
    _ignore_signals()
    if not _RAISE:  # still importing (install(prog) at the top of a command): nothing to unwind
        interrupted_exit(_PROG or os.path.basename(sys.argv[0] or "python"), signum)
    if _STOP_AT_SIGNAL:
        stop_children()
    raise Interrupted(signum)


def install(prog: str | None = None, *, stop_children_at_signal: bool = False) -> None:
    """Route SIGINT and SIGTERM of this process (main thread only) to :class:`Interrupted`, or, called
    at the top of a command's module before its slow imports and before :func:`run_main`, to
    :func:`interrupted_exit` at once (an import interrupted half-way has nothing to clean up)."""
    global _OWNER_PID, _STOP_AT_SIGNAL, _PROG
    _OWNER_PID = os.getpid()
    _STOP_AT_SIGNAL = stop_children_at_signal
    _PROG = prog or _PROG
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _handler)


def reinstall() -> None:
    """Put the handlers back after a library replaced them (``ray.init`` sets its own SIGTERM handler,
    ``sys.exit(15)``); does nothing unless :func:`install` ran in this process."""
    if _OWNER_PID == os.getpid():
        install(stop_children_at_signal=_STOP_AT_SIGNAL)


def stop_children(grace: float = 8.0) -> int:
    """Stop every descendant of this process: SIGTERM to the direct children (each may clean up its own),
    then, after at most ``grace`` seconds, SIGKILL to every descendant still alive. Returns how many there were."""
    import psutil

    try:
        me = psutil.Process()
        tree = me.children(recursive=True)
        direct = me.children()
    except psutil.Error:
        return 0
    for p in direct:
        try:
            p.terminate()
        except psutil.Error:
            pass
    psutil.wait_procs(direct, timeout=grace)
    try:
        tree = list({p.pid: p for p in [*tree, *me.children(recursive=True)]}.values())
    except psutil.Error:
        pass
    alive = [p for p in tree if p.is_running()]
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2.0)
    return len(tree)


def after_children_stopped(fn: Callable[[], object]) -> Callable[[], None]:
    """Have :func:`interrupted_exit` call ``fn`` once the children are stopped (a clean-up that needs them
    gone, such as removing the shared memory they mapped); an error in ``fn`` is ignored. Returns the call
    that takes ``fn`` back (the caller did its clean-up itself)."""
    _AFTER_STOP.append(fn)

    def cancel() -> None:
        if fn in _AFTER_STOP:
            _AFTER_STOP.remove(fn)

    return cancel


def interrupted_exit(prog: str, signum: int = signal.SIGINT, detail: str = "stopped") -> NoReturn:
    """Stop the children, print one line, exit ``128 + signum`` (module docstring)."""
    _ignore_signals()
    stop_children()
    for fn in _AFTER_STOP:
        try:
            fn()
        except Exception:  # noqa: BLE001 - the exit goes on whatever a clean-up does
            pass
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    try:
        print(f"{prog}: interrupted ({signal.Signals(signum).name}); {detail}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    os._exit(128 + signum)


def run_main(
    prog: str,
    main: Callable[..., int | None],
    *args,
    detail: str = "stopped",
    stop_children_at_signal: bool = False,
) -> NoReturn:
    """``sys.exit(main(*args))`` with the handlers of :func:`install`; an interrupt ends it through
    :func:`interrupted_exit`."""
    global _RAISE
    install(prog, stop_children_at_signal=stop_children_at_signal)
    _RAISE = True
    try:
        code = main(*args)
    except KeyboardInterrupt as exc:
        interrupted_exit(prog, getattr(exc, "signum", _RECEIVED or signal.SIGINT), detail)
    sys.exit(code)
