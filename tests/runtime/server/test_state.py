"""ServerState's drain wait: it returns False on timeout (on Python 3.10 too, where asyncio.wait_for raises
asyncio.TimeoutError, not the builtin TimeoutError) and True once the last request is done."""

from __future__ import annotations

import asyncio

from hpi_runtime.server.state import ServerSettings, ServerState


def test_wait_idle_times_out_while_busy_and_returns_once_idle() -> None:
    async def run() -> tuple[bool, bool]:
        state = ServerState(ServerSettings(served_model_name="m"))
        state.request_started()
        timed_out = await state.wait_idle(0.01)
        asyncio.get_running_loop().call_later(0.01, state.request_finished)
        return timed_out, await state.wait_idle(10)

    assert asyncio.run(run()) == (False, True)
