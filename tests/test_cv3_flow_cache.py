"""The exact incremental DiT flow: CosyVoice3 streams through the token2wav runner's flow state
cache (per CFM step and DiT layer: attention keys/values and the position convs' left context,
models/flow/prefix.py) give every streamed chunk the mel of upstream's full recompute, alone and
batched across streams at different cached prefixes, with and without a speaker's prompt prefix."""
import numpy as np
import pytest
import torch

from async_cosyvoice.model_dir import load_strict
from async_cosyvoice.models.cosyvoice3.flow import DiTFlow
from async_cosyvoice.models.cosyvoice3.hift import CausalHiFT
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream
from async_cosyvoice.token2wav.flow_cache import speaker_prefix_tokens, state_nbytes
from async_cosyvoice.token2wav.slot_calls import SlotCalls
from async_cosyvoice.token2wav.state_pool import StatePool

from cv3_fixture import cv3_dir, flow_dims, hift_dims
from test_flow_cache import drive, target_tokens

torch.set_num_threads(1)

PROMPTS = {"p24": "e2e_vc_stream_hop15.npz", "p16": "e2e_vc_stream_hop25_p16.npz"}  # 75 and 74 prompt tokens


@pytest.fixture(scope="module")
def d():
    return cv3_dir()


@pytest.fixture(scope="module")
def flow(d):
    f = DiTFlow(flow_dims(d))
    load_strict(f, torch.load(d / "flow.pt", map_location="cpu", weights_only=True), "flow.pt")
    return f.eval()


@pytest.fixture(scope="module")
def vocoder(d):
    return CausalHiFT(hift_dims(d)).eval()  # only its device matters: the flow is under test


@pytest.fixture(scope="module")
def prompts(d):
    out = {}
    for name, file in PROMPTS.items():
        z = np.load(d / "golden" / file)
        out[name] = tuple(torch.from_numpy(z[k]) for k in ("prompt_token", "prompt_feat", "embedding"))
    return out


def new_stream(prompts, name, first_hop, key=None):
    tok, feat, emb = prompts[name]
    return Token2WavStream(tok, feat, emb, schedule=ChunkSchedule(first_hop=first_hop), prompt_key=key)


@pytest.mark.parametrize("name,first_hop,key", [("p24", 15, None), ("p16", 25, None), ("p16", 10, "spk")])
def test_every_streamed_chunk_equals_the_recompute(flow, vocoder, prompts, name, first_hop, key):
    cached = Token2WavRunner(flow, vocoder)
    recompute = Token2WavRunner(flow, vocoder, flow_cache=False)
    stream = new_stream(prompts, name, first_hop, key)
    assert drive(cached, recompute, [stream], [target_tokens(120, seed=first_hop)]) >= 3
    assert stream.finished and stream.flow_state is None
    assert cached.stats.flow_cached_frames > 0
    assert cached.stats.flow_frames < recompute.stats.flow_frames
    if key is not None:
        assert len(cached.speaker_prefixes) == 1
        P = prompts[name][0].shape[1]
        assert cached.speaker_prefixes.get(key, prompts[name][0][0, :53]).tokens == speaker_prefix_tokens(P, 25, 3)


def test_batched_streams_with_different_cached_prefixes(flow, vocoder, prompts):
    cached = Token2WavRunner(flow, vocoder, length_bucket_ratio=100)  # one group: all items in each call
    recompute = Token2WavRunner(flow, vocoder, flow_cache=False)
    streams = [new_stream(prompts, "p24", 15), new_stream(prompts, "p16", 25, key="p16"),
               new_stream(prompts, "p24", 10, key="p24")]
    tokens = [target_tokens(n, seed) for n, seed in ((70, 1), (60, 2), (45, 3))]
    assert drive(cached, recompute, streams, tokens, first_round=[0, 0, 2]) >= 7
    assert all(s.finished for s in streams)
    assert cached.stats.flow_items > cached.stats.flow_calls


def test_state_size_from_dims_matches_the_state(flow, vocoder, prompts):
    """state_nbytes (speaker-prefix budgets at start-up, the memory report) counts what a DiT state holds."""
    runner = Token2WavRunner(flow, vocoder)
    state = runner._speaker_prefix(new_stream(prompts, "p24", 15, key="x"))
    assert state.tokens == 50
    assert state.nbytes() == state_nbytes(flow.dims, state.tokens, torch.float32)


def test_state_pool_chunks_equal_the_recompute(flow, vocoder, prompts):
    """The cache's state in a pool of slots (token2wav/state_pool.py, slot_calls.py; no CUDA graphs on
    CPU): every chunk of streams batched together, one from a speaker's prefix slot, equals the recompute."""
    pool = StatePool(flow, slots=3, slot_tokens=200, speaker_slots=1)
    cached = Token2WavRunner(flow, vocoder, length_bucket_ratio=100,
                             slot_calls=SlotCalls(flow, pool, cuda_graphs=False))
    recompute = Token2WavRunner(flow, vocoder, flow_cache=False)
    streams = [new_stream(prompts, "p24", 15), new_stream(prompts, "p16", 25, key="p16")]
    tokens = [target_tokens(n, seed) for n, seed in ((70, 11), (60, 12))]
    assert drive(cached, recompute, streams, tokens) >= 5
    assert cached.stats.flow_cached_frames > 0
