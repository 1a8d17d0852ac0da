"""A holder for a component's background tasks.

asyncio keeps only weak references to tasks, so a fire-and-forget task can vanish mid-flight; and a
component that starts tasks must stop them when it closes. `BackgroundTasks` does both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task:
        """Start `coroutine` on the running loop; the task is held until it finishes or `close()`."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning(f"background task {task.get_name()} failed: {task.exception()!r}")

    def cancel(self) -> None:
        """Cancel every held task (for synchronous close paths; `close()` also waits)."""
        for task in self._tasks:
            task.cancel()

    async def close(self) -> None:
        """Cancel every held task and wait until they have all finished."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._tasks)
