"""FirstChunksOwed (token2wav/first_chunks.py): how long background work waits for streams owed
their first chunk. The batcher's use of it: tests/test_background_captures.py."""
import asyncio

import pytest

from async_cosyvoice.token2wav.first_chunks import FirstChunksOwed


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_nothing_owed_gives_way_at_once():
    owed = FirstChunksOwed(clock=Clock())
    assert asyncio.run(owed.give_way()) == 0.0 and owed.owed == 0


def test_waits_until_the_young_stream_is_served():
    async def scenario():
        owed = FirstChunksOwed(grace_s=60.0, max_wait_s=60.0)
        owed.started(1)
        waiting = asyncio.ensure_future(owed.give_way())
        await asyncio.sleep(0.05)
        before = waiting.done()
        owed.served(1)
        owed.served(1)  # served twice (first job done, then the stream ended): no harm
        return before, await asyncio.wait_for(waiting, 5), owed.owed

    before, waited, left = asyncio.run(scenario())
    assert not before and 0.05 <= waited < 60.0 and left == 0


def test_streams_older_than_the_grace_hold_nothing_back():
    clock = Clock()
    owed = FirstChunksOwed(grace_s=1.0, max_wait_s=60.0, clock=clock)
    owed.started(1)
    clock.t += 1.5
    assert asyncio.run(owed.give_way()) == 0.0 and owed.owed == 1


def test_never_waits_past_max_wait():
    """Arrivals that never stop (a young stream always owed) delay a capture by max_wait_s at most."""
    async def scenario():
        owed = FirstChunksOwed(grace_s=60.0, max_wait_s=0.1)
        owed.started(1)
        return await asyncio.wait_for(owed.give_way(), 5)

    assert 0.1 <= asyncio.run(scenario()) < 5


def test_the_wait_ends_when_the_youngest_ages_out():
    async def scenario():
        owed = FirstChunksOwed(grace_s=0.1, max_wait_s=60.0)
        owed.started(1)
        return await asyncio.wait_for(owed.give_way(), 5), owed.owed

    waited, left = asyncio.run(scenario())
    assert 0.09 <= waited < 5 and left == 1


def test_rejects_negative_limits():
    with pytest.raises(ValueError, match="must be >= 0"):
        FirstChunksOwed(grace_s=-1)
