"""What an open Queue page costs the daemon: each waiter's reasons (a `whoami`) are asked once
while the queue's order stays the same, and again as soon as it changes (the CPU it saves:
bench/web_bench.py, the daemon's CPU with an admin's Queue page open)."""
from __future__ import annotations

from test_web_app import log_in, run_with_state, status

from gpuguard.web.app import MEMO_AGE
from gpuguard.web.sources import Memo, ServerStatus


def test_the_reasons_are_asked_once_while_the_order_stands_and_again_when_it_changes():
    async def scenario(client, source, state):
        await log_in(client, "root2")
        for _ in range(3):
            assert "carol" in await (await client.get("/fragment/queue")).text()
        assert source.calls.count(("whoami", "carol")) == 1

        changed = status()
        changed["queue"].insert(0, {"position": 1, "user": "dave", "gpus": 2, "since": 0.0, "priority": 5})

        async def servers():
            return [ServerStatus("gpu1", changed)]
        source.servers = servers
        state.memo = Memo(MEMO_AGE)  # the next second's status: dave joined ahead of carol
        text = await (await client.get("/fragment/queue")).text()
        assert "dave" in text and source.calls.count(("whoami", "carol")) == 2
    run_with_state(scenario)
