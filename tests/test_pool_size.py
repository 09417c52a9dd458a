"""Sizing a state pool from the device's free memory (token2wav/pool_size.py): a count that does not
fit fails with one line naming the settings and the largest count that fits; "auto" takes that count."""
import pytest

from async_cosyvoice.config import Token2WavConfig
from async_cosyvoice.token2wav.pool_size import PoolTooLarge, stream_slots

GiB = 2**30
H200_SLOT = int(1.76 * GiB)  # a 400-token slot of the full-size flow in fp16 (docs/flow-cache.md)


def test_a_count_that_fits_is_kept():
    assert stream_slots(40, slot_bytes=H200_SLOT, speaker_slots=1, free_bytes=130 * GiB, fraction=0.6,
                        slot_tokens=400) == 40


def test_a_count_too_large_names_the_settings_and_what_fits():
    # 0.6 x 130 GiB = 78 GiB = 44 slots of 1.76 GiB, less scratch and one speaker slot: 42
    with pytest.raises(PoolTooLarge) as e:
        stream_slots(48, slot_bytes=H200_SLOT, speaker_slots=1, free_bytes=130 * GiB, fraction=0.6, slot_tokens=400)
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("token2wav.flow_cache_slots: 48 slots", "flow_cache_slot_tokens", "1.76 GiB per 400-token slot",
                 "at most 42 fit", "flow_cache_slots: auto"):
        assert part in msg, (part, msg)


def test_auto_takes_the_largest_count_that_fits_up_to_the_streams():
    assert stream_slots("auto", slot_bytes=H200_SLOT, speaker_slots=1, free_bytes=130 * GiB, fraction=0.6,
                        slot_tokens=400) == 42
    assert stream_slots("auto", slot_bytes=H200_SLOT, speaker_slots=1, free_bytes=130 * GiB, fraction=0.6,
                        slot_tokens=400, max_slots=16) == 16
    assert stream_slots("auto", slot_bytes=GiB, speaker_slots=0, free_bytes=10 * GiB, fraction=1.0,
                        slot_tokens=400) == 9  # exactly 10 slots' worth: 9 + scratch


def test_not_even_one_slot_fails_clearly():
    with pytest.raises(PoolTooLarge, match="not even one slot fits"):
        stream_slots("auto", slot_bytes=H200_SLOT, speaker_slots=1, free_bytes=4 * GiB, fraction=0.6, slot_tokens=400)


def test_the_config_takes_auto_and_counts():
    assert Token2WavConfig(flow_cache_slots="auto").flow_cache_slots == "auto"
    assert Token2WavConfig(flow_cache_slots=8).flow_cache_slots == 8
    for bad in (0, "many"):
        with pytest.raises(ValueError):
            Token2WavConfig(flow_cache_slots=bad)
