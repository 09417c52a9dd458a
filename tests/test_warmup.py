"""Warm-up: the fixed CUDA-graph capture set (from the config alone, never from the registered
speakers), its coverage of the common path, Dynamo's recompiles across it; the LM lengths its
requests run; the heap it leaves frozen; torch.compile's cache folder."""
import gc
import os

import pytest
import torch
from torch._dynamo.utils import counters

from async_cosyvoice.config import Config
from async_cosyvoice.estimator.torch_backend import CompiledEstimator
from async_cosyvoice.frontend.audio import load_audio
from async_cosyvoice.gc_pauses import GC_PAUSES
from async_cosyvoice.graph_buckets import CapturePlan, batch_sizes
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.llm import prompt_parts
from async_cosyvoice.request import Mode, SynthesisOptions, SynthesisRequest
from async_cosyvoice.token2wav import ChunkSchedule
from async_cosyvoice.token2wav.flow_graphs import FlowGraphs
from async_cosyvoice.token2wav.hift_graphs import HiFTGraphs
from async_cosyvoice.tts import SyncSynthesizer
from async_cosyvoice.warmup import (
    capture_plan,
    chunk_mel_frames,
    compile_in_use,
    sine_prompt,
    use_compile_cache,
)

TRANSCRIPT = "The morning train was late again."


def test_batch_sizes():
    assert batch_sizes(1) == [1]
    assert batch_sizes(4) == [1, 2, 4]
    assert batch_sizes(5) == [1, 2, 4, 5]


@pytest.fixture(scope="module")
def tiny_models(tiny_dir):
    return build_models(load_model_dir(tiny_dir), device="cpu", with_llm=False)


def plan_buckets(models, plan: CapturePlan, estimator=None) -> tuple[FlowGraphs, HiFTGraphs, list, list]:
    """The planned buckets, as the GPU's stage would capture them (graphs off CUDA: nothing captured)."""
    flow = FlowGraphs(models.flow, estimator or models.flow.decoder.estimator, cuda_graphs=False)
    hift = HiFTGraphs(models.hift, cache_samples=ChunkSchedule().source_cache_len, cuda_graphs=False)
    return (flow, hift, [b for s, ls in plan.flow for b in flow.buckets(s, ls)],
            [b for s, ls in plan.hift for b in hift.buckets(s, ls)])


def test_capture_plan_is_small_fixed_and_covers_one_stream(tiny_models):
    config = Config()
    flow, hift, flow_buckets, hift_buckets = plan_buckets(tiny_models, capture_plan(config))
    # 1 stream: every flow token bucket up to 10 s of prompt + 10 s of speech (500 tokens), HiFT's chunk lengths
    assert flow_buckets == [(1, 32 * k) for k in range(1, 17)]
    assert hift_buckets == [(1, 16 * k) for k in range(1, 10)]
    # the common path never meets an uncaptured bucket: any prompt <= 10 s, any chunk of <= 10 s of
    # speech (first, following, final), and every HiFT chunk (first hop .. longest hop + look-ahead)
    for prompt in range(1, config.warmup.capture_prompt_tokens + 1):
        for tokens in range(1, config.warmup.capture_speech_tokens + 1):
            assert flow.bucket(1, prompt + tokens) in flow_buckets, (prompt, tokens)
    for frames in range(2, chunk_mel_frames(config)[-1] + 1):
        assert hift.bucket(1, frames) in hift_buckets, frames
    # more streams only when asked: their first chunks (prompt + a padded first hop + look-ahead)
    more = Config.model_validate({"warmup": {"capture_streams": 4}})
    _, _, flow4, hift4 = plan_buckets(tiny_models, capture_plan(more))
    assert flow4[:16] == flow_buckets and hift4[:9] == hift_buckets
    length = config.warmup.capture_prompt_tokens + 2 * config.token2wav.first_hop + 3
    assert {b for b in flow4[16:]} == {(s, 32 * k) for s in (2, 4) for k in range(1, -(-length // 32) + 1)}
    assert {b for b in hift4[9:]} == {(s, 16 * k) for s in (2, 4) for k in range(1, 10)}
    assert length < 320


def test_first_chunk_plan_covers_every_first_chunk_and_is_part_of_the_plan(tiny_models):
    """`capture_before_serving: first_chunks` captures before SERVING the plan's buckets that a new
    request's first chunk can meet (any prompt <= capture_prompt_tokens, a padded first hop, the
    look-ahead) and every HiFT chunk; the rest of the plan is left to the capture thread."""
    config = Config.model_validate({"warmup": {"capture_before_serving": "first_chunks"}})
    flow, hift, first_flow, first_hift = plan_buckets(tiny_models, capture_plan(config, before_serving=True))
    _, _, all_flow, all_hift = plan_buckets(tiny_models, capture_plan(config))
    assert set(first_flow) < set(all_flow) and first_hift == all_hift
    first_hop, lookahead = config.token2wav.first_hop, 3
    for prompt in range(1, config.warmup.capture_prompt_tokens + 1):
        for hop in range(first_hop, 2 * first_hop):  # prompt_align pads the first hop to < 2 first hops
            assert flow.bucket(1, prompt + hop + lookahead) in first_flow, (prompt, hop)
    assert len(first_flow) == 9 and len(all_flow) == 16  # 32-token buckets up to 283 tokens of 500


@pytest.mark.parametrize("streams", [1, 4])
def test_covering_plan_covers_every_first_chunk_with_two_graphs_per_stream_count(tiny_models, streams):
    """`capture_before_serving: covering` (the default) captures before SERVING the shortest and the
    longest first-chunk bucket at each stream count: by the graphs' own cover rule
    (GraphBuckets.cover) the longest runs every other first chunk and HiFT chunk until its own graph
    is captured, and the length extremes that compile_shapes runs stay those of `first_chunks`."""
    config = Config.model_validate({"warmup": {"capture_streams": streams}})
    assert config.warmup.capture_before_serving == "covering"
    first_only = Config.model_validate({"warmup": {"capture_streams": streams, "capture_before_serving": "first_chunks"}})
    flow, hift, cover_flow, cover_hift = plan_buckets(tiny_models, capture_plan(config, before_serving=True))
    _, _, first_flow, first_hift = plan_buckets(tiny_models, capture_plan(first_only, before_serving=True))
    n = len(batch_sizes(streams))
    assert len(cover_flow) == len(cover_hift) == 2 * n and set(cover_flow) < set(first_flow)
    assert set(cover_hift) < set(first_hift)
    flow.graphs, hift.graphs = dict.fromkeys(cover_flow), dict.fromkeys(cover_hift)  # as if captured
    for bucket in first_flow:
        assert bucket in cover_flow or flow.cover(bucket) is not None, bucket
    for bucket in first_hift:
        assert bucket in cover_hift or hift.cover(bucket) is not None, bucket
    for plan in (capture_plan(config, before_serving=True), capture_plan(first_only, before_serving=True)):
        assert [(s, (ls[0], ls[-1])) for s, ls in plan.flow] == [
            (s, (ls[0], ls[-1])) for s, ls in capture_plan(first_only, before_serving=True).flow]


def test_capture_set_does_not_depend_on_registered_speakers(tiny_dir, tmp_path):
    """The warm-up asks the token2wav stage to capture the same first-chunk plan with or without
    registered speakers, runs its generated prompts' requests, none by the speakers, then leaves the
    whole plan (and what the requests wanted beyond it) to the capture thread (`defer`)."""
    prompt = load_audio(tiny_dir / "golden" / "prompt_24k.wav")
    config = Config.model_validate({"model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(tmp_path / "spk")},
                                    "warmup": {"coverage": True}})
    seen = []

    def recording(synth):
        async def synthesize(request):
            seen.append(("request", request.mode))
            async for chunk in synth.synthesize(request):
                yield chunk

        async def capture(plan, **how):
            seen.append(("capture", plan, how))
            return await synth.batcher.capture_graphs(plan, **how)
        return synthesize, capture

    plans = []
    for registered in (False, True):
        with SyncSynthesizer(config, warmup=False) as s:
            if registered:
                s.register_speaker("long", TRANSCRIPT, prompt)  # before the warm-up: a restart's store
            synthesize, capture = recording(s.synth)
            s.synth.warming.capture = capture
            seen.clear()
            s.call(s.synth.warming.run(synthesize))
            # generated prompts of 5 and 10 s (the longest the set covers): test_warmup_runs_the_lm_...
            assert seen[1:3] == [("request", Mode.ZERO_SHOT), ("request", Mode.ZERO_SHOT)]
            # the first chunks' plan first; after the requests the whole plan, deferred (graph_buckets.py)
            assert [what for what, *_ in seen] == ["capture", "request", "request", "capture"]
            assert seen[0][2] == {} and seen[3][1:] == (capture_plan(config), {"defer": True})
            plans.append(seen[0][1])
    assert plans[0] == plans[1] == capture_plan(config, before_serving=True)


def test_warmup_runs_the_lm_decode_graphs_of_a_speakers_first_chunk(tiny_dir, tmp_path):
    """Issue 23: the first request after SERVING (a speaker registered from a 6-s prompt) was the first
    to run the LM decode graph of its first chunk's attention-length bucket (256 positions): the
    warm-up's one request had a 10-s prompt (512). Now the warm-up's requests run the buckets of the
    first chunks of 3.5-10 s prompts (and prefill a 5-s and a 10-s prompt)."""
    config = Config.model_validate({"model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(tmp_path / "spk")},
                                    "warmup": {"coverage": True}})
    first_chunk_tokens = config.token2wav.first_hop + 3  # the first hop and the flow's look-ahead
    with SyncSynthesizer(config, warmup=False) as s:
        synth = s.synth
        runner = synth.engine.runner

        def first_chunk_graphs(request: SynthesisRequest) -> set[tuple[int, int]]:
            """The decode graphs (batch, attention length) of the steps of the request's first chunk."""
            request = synth.rules.check(request)
            (inputs,) = s.call(synth.model_inputs(request, s.call(synth.prepare_voice(request))))
            prefill = sum(len(ids) for _, ids in prompt_parts(inputs.lm_text_tokens, inputs.llm_prompt_speech_token,
                                                               runner.model.ids))
            return {runner.decode_graph_key(1, prefill + k) for k in range(1, first_chunk_tokens + 1)}

        warmed = set().union(*(first_chunk_graphs(r) for r in synth.warming.requests()))
        assert warmed == {(1, 256), (1, 512)}
        for seconds in (3.5, 6.0, 10.0):  # the server bench's speaker: 6 s
            s.register_speaker("spk", TRANSCRIPT, sine_prompt(16000, seconds), overwrite=True)
            graphs = first_chunk_graphs(SynthesisRequest(
                Mode.ZERO_SHOT_BY_SPK_ID, text="The quick brown fox jumps over the lazy dog, and the morning "
                "train leaves the station on time.", speaker_id="spk", options=SynthesisOptions(stream=True)))
            assert graphs <= warmed, (seconds, graphs)


def test_warmup_leaves_the_heap_collected_and_frozen(tiny_dir, tmp_path):
    """The start's objects are frozen after the warm-up (no full collection in a request scans them),
    and a synthesizer's close unfreezes them (the interpreter's last collection frees them)."""
    config = Config.model_validate({"model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(tmp_path / "spk")}})
    with SyncSynthesizer(config, warmup=True) as s:
        frozen = gc.get_freeze_count()
        assert frozen > 100_000  # the modules, the ONNX sessions, the tokenizer, ...
        assert len(gc.get_objects()) < frozen / 10  # what a full collection still scans
        assert GC_PAUSES in gc.callbacks  # long full collections while serving are logged
        assert list(s.synthesize(SynthesisRequest(Mode.CROSS_LINGUAL, text="Hello.", prompt_audio=sine_prompt(16000),
                                                  options=SynthesisOptions(max_tokens=20))))
    assert gc.get_freeze_count() == 0 and GC_PAUSES not in gc.callbacks


@pytest.mark.slow
def test_compiled_estimator_compiles_once_for_every_planned_bucket(tiny_models, tmp_path, monkeypatch):
    """The flow graphs run the compiled estimator (dynamic shapes) at every planned bucket: one Dynamo
    frame, no recompile, so a capture never waits for a compile (Dynamo's decisions; backend eager
    keeps the test in seconds)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "tc"))
    torch._dynamo.reset()
    counters.clear()
    estimator = CompiledEstimator(tiny_models.flow.decoder.estimator, compile=True, cuda_graphs=False,
                                  compile_options={"backend": "eager"})
    plan = capture_plan(Config.model_validate({"warmup": {"capture_streams": 4, "capture_prompt_tokens": 100,
                                                          "capture_speech_tokens": 100}}))
    flow, _, flow_buckets, _ = plan_buckets(tiny_models, plan, estimator.capturable)
    with torch.inference_mode():
        for bucket in flow_buckets:
            flow._run(bucket, flow._example(bucket))
    assert len(flow_buckets) > 8
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0
    torch._dynamo.reset()


def test_compile_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    config = Config.model_validate({"warmup": {"compile_cache_dir": str(tmp_path / "tc")}})
    assert use_compile_cache(config) == tmp_path / "tc"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "tc")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the operator's choice wins
    assert use_compile_cache(config) == tmp_path / "mine"


def test_inductors_own_default_is_not_the_operators_choice(tmp_path, monkeypatch):
    """Importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR to inductor's default when it is unset:
    that must not hide warmup.compile_cache_dir (it did: every server used /tmp/torchinductor_<user>)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert cache_dir() == os.path.abspath(default_cache_dir())  # what torch does on its own
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == cache_dir()
    config = Config.model_validate({"warmup": {"compile_cache_dir": str(tmp_path / "tc")}})
    assert use_compile_cache(config) == tmp_path / "tc"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "tc")


@pytest.mark.parametrize("overrides, expected", [
    ({}, False),
    ({"model": {"device": "cuda"}}, True),  # engine.cuda_graphs defaults to true
    ({"model": {"device": "cuda"}, "engine": {"cuda_graphs": False}}, False),
    ({"model": {"device": "cuda"}, "engine": {"cuda_graphs": False}, "token2wav": {"estimator": "compiled"}}, True),
])
def test_compile_in_use(overrides, expected):
    assert compile_in_use(Config.model_validate(overrides)) is expected


def test_capture_plan_covers_cosyvoice3s_causal_vocoder(tiny3_dir):
    """CausalHiFT re-vocodes all the mel so far: at 1 stream every frame bucket up to 10 s of speech's mel."""
    models = build_models(load_model_dir(tiny3_dir), device="cpu", with_llm=False)
    config = Config()
    plan = capture_plan(config)
    hift = HiFTGraphs(models.hift, cache_samples=0, cuda_graphs=False)
    buckets = [b for s, ls in plan.causal_hift for b in hift.buckets(s, ls)]
    assert buckets[0] == (1, 16) and all(b[0] == 1 for b in buckets) and len(buckets) <= 26
    for frames in range(2, 2 * (config.warmup.capture_speech_tokens + 3) + 1):
        assert hift.bucket(1, frames) in buckets, frames
