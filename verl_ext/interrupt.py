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

Whatever the command's libraries make of the interrupt (Ray's ``ray.get`` re-raises a plain
``KeyboardInterrupt``; a library may wrap it in its own error, or catch it and go on), the command ends
the same way: an exception or a return out of ``main`` after a signal ends through
:func:`interrupted_exit`, and a command still running ``deadline`` seconds after the signal is ended
from a watchdog thread.

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
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

_OWNER_PID: int | None = None
_AFTER_STOP: list[Callable[[], object]] = []  # run by interrupted_exit once the children are stopped
_STOP_AT_SIGNAL = False
_PROG: str | None = None  # set by install(prog) before run_main: a signal then exits at once (imports)
_RAISE = False  # run_main is running main: a signal raises Interrupted so finally blocks run
_RECEIVED: int | None = None  # the signal the handler took: a library that turns Interrupted into a plain
# KeyboardInterrupt (Ray's ray.get does) must not make a SIGTERM look like a Ctrl-C
_DETAIL: str | Callable[[], str] = "stopped"  # run_main's detail, or set_detail's (a callable: read at exit)
_DEADLINE: float | None = None  # seconds from the signal to the watchdog's exit (run_main's deadline)
_EXITING = threading.Lock()  # one interrupted_exit: the main thread's or the watchdog's


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
    prog = _PROG or os.path.basename(sys.argv[0] or "python")
    if not _RAISE:  # still importing (install(prog) at the top of a command): nothing to unwind
        interrupted_exit(prog, signum)
    if _DEADLINE is not None:  # main's unwinding may be swallowed or stuck: end the run from a thread then
        watchdog = threading.Timer(_DEADLINE, lambda: interrupted_exit(prog, signum, _DETAIL))
        watchdog.daemon = True
        watchdog.start()
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


def received() -> int | None:
    """The signal this process's handler took, or None: an error that reaches a command's own code after
    it is the interrupt's doing (a library wrapped or replaced the ``KeyboardInterrupt``)."""
    return _RECEIVED


@contextmanager
def errors_as_interrupt() -> Iterator[None]:
    """Inside, an error raised after a signal leaves as :class:`Interrupted`: a framework between the
    command's code and :func:`run_main` (Hydra's job runner) catches ``Exception`` and prints it as a
    failed job, but lets a ``KeyboardInterrupt`` through."""
    try:
        yield
    except Exception:
        if _RECEIVED is None:
            raise
        raise Interrupted(_RECEIVED) from None


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


def set_detail(detail: str | Callable[[], str]) -> None:
    """What the interrupt line says after ``interrupted (SIGINT);`` from now on, in place of run_main's
    ``detail``: a text, or a callable asked at exit time (e.g. the newest checkpoint then); a callable that
    fails leaves the text ``stopped``."""
    global _DETAIL
    _DETAIL = detail


def interrupted_exit(prog: str, signum: int = signal.SIGINT, detail: str | Callable[[], str] = "stopped") -> NoReturn:
    """Stop the children, print one line, exit ``128 + signum`` (module docstring)."""
    end_process(f"{prog}: interrupted ({signal.Signals(signum).name}); {{detail}}", 128 + signum, detail)


def end_process(line: str, code: int, detail: str | Callable[[], str] = "") -> NoReturn:
    """Stop the children, run the clean-ups of :func:`after_children_stopped`, print ``line`` to stderr and
    exit with ``code``, from any thread (a watchdog's too). Called from two threads at once, the second
    caller waits for the first's exit. A ``{detail}`` in ``line`` is replaced by ``detail`` (a callable is
    called once the children are stopped, so it sees what they left: the newest checkpoint)."""
    _EXITING.acquire()
    if threading.current_thread() is threading.main_thread():  # signal.signal works there alone
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
    if "{detail}" in line:
        try:
            text = detail() if callable(detail) else detail
        except Exception:  # noqa: BLE001 - the exit goes on with the plain detail
            text = "stopped"
        line = line.replace("{detail}", text)
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    os._exit(code)


class EndAtSignal:
    """While the main thread waits inside a C call that does not return to Python for a long time (``ray.init``
    retrying a cluster's GCS), a signal's Python handler runs only once the call returns (measured: ~40 s).
    Between :meth:`start` and :meth:`stop`, a thread reads the signal module's wakeup fd, which the
    interpreter writes the moment a signal with a Python handler arrives, and ends the process at once
    through :func:`end_process` (one line ``PROG: interrupted (SIGTERM) <during>``, ``128 + signal``).
    Only SIGINT and SIGTERM end it; :meth:`start` and :meth:`stop` must be called from the main thread."""

    def __init__(self, prog: str, during: str):
        self._prog, self._during = prog, during
        self._pipe: tuple[int, int] | None = None
        self._previous = -1
        self._stopped = threading.Event()

    def start(self) -> EndAtSignal:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread alone
            return self
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._pipe = (read, write)
        threading.Thread(target=self._watch, args=(read,), name="end-at-signal", daemon=True).start()
        return self

    def _watch(self, read: int) -> None:
        try:
            while not self._stopped.is_set():
                data = os.read(read, 64)
                if self._stopped.is_set() or not data:
                    return
                for signum in data:
                    if signum in (signal.SIGINT, signal.SIGTERM):
                        name = signal.Signals(signum).name
                        end_process(f"{self._prog}: interrupted ({name}) {self._during}", 128 + signum)
        except OSError:
            return
        finally:
            os.close(read)

    def exit_if_signalled(self, exc: SystemExit) -> None:
        """A ``SystemExit(SIGTERM)`` out of the call is a library's handler for the signal (``ray.init`` installs
        one that calls ``sys.exit(15)``, which may run before this thread): end the process the same way."""
        if exc.code in (signal.SIGINT, signal.SIGTERM):
            name = signal.Signals(exc.code).name
            end_process(f"{self._prog}: interrupted ({name}) {self._during}", 128 + int(exc.code))

    def stop(self) -> None:
        if self._pipe is None or self._stopped.is_set():
            return
        self._stopped.set()
        signal.set_wakeup_fd(self._previous)
        read, write = self._pipe
        try:
            os.write(write, b"\0")  # wakes the thread, which sees it is stopped
        except OSError:
            pass
        os.close(write)  # the thread closes the read end


def run_main(
    prog: str,
    main: Callable[..., int | None],
    *args,
    detail: str = "stopped",
    stop_children_at_signal: bool = False,
    deadline: float | None = 30.0,
) -> NoReturn:
    """``sys.exit(main(*args))`` with the handlers of :func:`install`; an interrupt ends it through
    :func:`interrupted_exit`, from the main thread, or from a watchdog ``deadline`` seconds after the
    signal when ``main`` has not let the interrupt out by then (None: no watchdog)."""
    global _RAISE, _DETAIL, _DEADLINE
    install(prog, stop_children_at_signal=stop_children_at_signal)
    _DETAIL, _DEADLINE, _RAISE = detail, deadline, True
    try:
        code = main(*args)
    except BaseException as exc:  # noqa: BLE001 - after a signal, whatever comes out is the interrupt
        if not isinstance(exc, KeyboardInterrupt) and _RECEIVED is None:
            raise
        interrupted_exit(prog, getattr(exc, "signum", _RECEIVED or signal.SIGINT), _DETAIL)
    if _RECEIVED is not None:  # main went on after the signal (a library caught the interrupt) and returned
        interrupted_exit(prog, _RECEIVED, _DETAIL)
    sys.exit(code)
