"""Executing a notebook headless: papermill's engine with a client that cannot stall on a lost wake-up.

ZeroMQ's edge-triggered fd can lose an edge (RESEARCH.md 15), so every receive waits in :data:`SLICE_S` slices."""

from __future__ import annotations

import logging
import time
from queue import Empty

import nbformat
from nbclient.exceptions import CellExecutionError
from nbclient.util import run_sync
from papermill.clientwrap import PapermillNotebookClient
from papermill.engines import NBClientEngine, papermill_engines

__all__ = ["ENGINE", "SLICE_S", "IDLE_GRACE_S", "StalledCell"]

ENGINE = "fastattn"
#: the longest a receive waits on the socket's fd before it polls the socket itself
SLICE_S = 1.0
#: how long a reply may lag behind its kernel's "idle" before the cell is ended as stalled
IDLE_GRACE_S = 30.0


class StalledCell(Exception):
    """The kernel reported the cell idle, but its reply never came."""


def _sliced(get_msg, on_empty=None, on_msg=None):
    """``get_msg`` waiting SLICE_S at a time; ``on_empty()`` runs between slices, ``on_msg(m)`` per message."""
    async def get(timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = SLICE_S if deadline is None else max(0.0, min(SLICE_S, deadline - time.monotonic()))
            try:
                msg = await get_msg(timeout=left)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                if on_empty:
                    on_empty()
                continue
            if on_msg:
                on_msg(msg)
            return msg
    return get


class SliceClient(PapermillNotebookClient):
    """papermill's client with sliced shell and IOPub receives that ends a cell stalled on an idle kernel."""

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        self._pending, self._idle_at = None, {}
        send = kc.execute

        def execute(*args, **kw):  # the request whose reply the shell channel now waits for
            msg_id = send(*args, **kw)
            self._pending = msg_id if isinstance(msg_id, str) else self._pending
            return msg_id
        kc.execute = execute
        kc.iopub_channel.get_msg = _sliced(kc.iopub_channel.get_msg, on_msg=self._saw)
        kc.shell_channel.get_msg = _sliced(kc.shell_channel.get_msg, on_empty=self._check_idle)
        return kc

    def _saw(self, msg: dict) -> None:
        if msg.get("msg_type") == "status" and msg["content"].get("execution_state") == "idle":
            self._idle_at.setdefault(msg["parent_header"].get("msg_id"), time.monotonic())

    def _check_idle(self) -> None:
        since = self._idle_at.get(self._pending)
        if since is not None and time.monotonic() - since > IDLE_GRACE_S:
            raise StalledCell(f"the kernel went idle {time.monotonic() - since:.0f} s ago and sent no reply")

    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
        try:
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        except StalledCell as exc:
            first = (cell.source.strip().splitlines() or [""])[0][:80]
            text = f"cell {cell_index} ({first!r}) stalled: {exc}"
            cell.outputs.append(nbformat.v4.new_output("error", ename="StalledCell", evalue=text, traceback=[text]))
            raise CellExecutionError(text, "StalledCell", text) from exc

    # nbclient binds its blocking names to its own coroutines: rebind them to these
    start_new_kernel_client = run_sync(async_start_new_kernel_client)
    execute_cell = run_sync(async_execute_cell)


class SliceEngine(NBClientEngine):

    @classmethod
    def execute_managed_notebook(cls, nb_man, kernel_name, log_output=False, stdout_file=None, stderr_file=None,
                                 start_timeout=60, execution_timeout=None, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("input_path", "timeout", "startup_timeout")}
        return SliceClient(nb_man, timeout=execution_timeout, startup_timeout=start_timeout, kernel_name=kernel_name,
                           log=logging.getLogger("papermill"), log_output=log_output, stdout_file=stdout_file,
                           stderr_file=stderr_file, **kwargs).execute()


papermill_engines.register(ENGINE, SliceEngine)
