"""The full-screen live loop: fetch a snapshot every period, redraw on new data, a key or a resize,
and give the terminal back as it was on every exit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator

from rich.console import Console, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from node.monitor.dashboard.render import render
from node.monitor.dashboard.state import DashboardState
from node.monitor.dashboard.text import safe_text
from node.runtime.tasks import BackgroundTasks


@contextlib.contextmanager
def _cbreak(fd: int) -> Iterator[None]:
    """Put the terminal in cbreak mode (keys arrive one by one, Ctrl-C still interrupts) and
    restore it on the way out, whatever happens."""
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _stdin_tty_fd() -> int | None:
    try:
        stream = sys.stdin
        if stream is None or not stream.isatty():
            return None
        return stream.fileno()
    except (AttributeError, ValueError, OSError):
        return None


async def run_live(
    provider: Callable[[], Awaitable[dict]],
    refresh: float = 1.5,
    console: Console | None = None,
    *,
    timeout: float | None = None,
) -> int:
    """The full-screen dashboard. Every `refresh` seconds awaits `provider()` for a snapshot (a
    failure or a call slower than `timeout`, default max(10, 5 * refresh), shows "reconnecting:
    <reason>" in the header and is retried next period). Returns 0 when the user presses q; runs
    until cancelled otherwise (CancelledError propagates). The terminal is restored on every exit.
    Keys are read only when stdin is a TTY."""
    console = console or Console()
    refresh = max(float(refresh), 0.05)
    call_timeout = timeout if timeout is not None else max(10.0, 5.0 * refresh)
    state = DashboardState()
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    quit_requested = asyncio.Event()

    async def fetch_forever() -> None:
        while True:
            started = loop.time()
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
                async with asyncio.timeout(call_timeout):
                    snapshot = await provider()
                state.update(snapshot)
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                state.set_error(f"no snapshot within {call_timeout:g}s")
            except Exception as exc:  # any provider failure is shown, never raised
                state.set_error(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            wake.set()
            await asyncio.sleep(max(refresh - (loop.time() - started), 0.05))

    def on_keys(fd: int) -> None:
        try:
            data = os.read(fd, 1024)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            loop.remove_reader(fd)
            return
        if not data:  # EOF on the terminal: stop reading, keep running
            loop.remove_reader(fd)
            return
        if state.feed(data.decode("utf-8", errors="ignore")):
            quit_requested.set()
        wake.set()

    def frame() -> RenderableType:
        size = console.size
        try:
            return render(state, size.width, size.height)
        except Exception as exc:  # a snapshot we failed to foresee: say so, keep running
            return Panel(
                Text(
                    f"cannot render this snapshot: {type(exc).__name__}: {safe_text(str(exc), 200)}\nq quits",
                    style="bold red",
                ),
                title="pipeswarm dashboard",
            )

    fd = _stdin_tty_fd()
    tasks = BackgroundTasks()
    with contextlib.ExitStack() as stack:
        if fd is not None:
            stack.enter_context(_cbreak(fd))
        live = stack.enter_context(Live(frame(), console=console, screen=True, auto_refresh=False, transient=False))
        if fd is not None:
            loop.add_reader(fd, on_keys, fd)
            stack.callback(loop.remove_reader, fd)
        with contextlib.suppress(AttributeError, NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGWINCH, wake.set)  # redraw at once on resize
            stack.callback(loop.remove_signal_handler, signal.SIGWINCH)
        fetcher = tasks.spawn(fetch_forever(), name="dashboard-fetch")
        try:
            while not quit_requested.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(refresh):
                        await wake.wait()
                wake.clear()
                if fetcher.done() and not fetcher.cancelled() and fetcher.exception() is not None:
                    # cannot happen (fetch_forever catches everything) but never die silently
                    state.set_error(repr(fetcher.exception()))
                    fetcher = tasks.spawn(fetch_forever(), name="dashboard-fetch")
                live.update(frame(), refresh=True)
            return 0
        finally:
            await tasks.close()
