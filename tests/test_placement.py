"""Several devices behind one gRPC server: replicas on [cpu, cpu] (routing by load, one shared
speaker store, per-device metrics, the benchmark client, one replica stopping under load) and
the disaggregated placement on [cpu, cpu, cpu] (LLM + two token2wav workers), each a real server
on 127.0.0.1 with the fixture model."""
from __future__ import annotations

import asyncio
import gc
import json
import re
import urllib.request

import grpc
import numpy as np
import pytest

from cosyvoice_cli.cli import main as cli_main
from async_cosyvoice.config import Config
from async_cosyvoice.models.flow.flow import Flow
from async_cosyvoice.models.hift import HiFT
from async_cosyvoice.models.llm import CosyVoice2LM
from async_cosyvoice.placement import ReplicaRouter, Token2WavPool, device_stats
from grpc_async.client import CosyVoiceClient, chunk_samples
from grpc_async.server import ServerThread

pytestmark = pytest.mark.slow

TEXT = "Hello there, this is a small test."
PROMPT_TEXT = "The morning train was late again, so I walked along the river."


def _server(tiny_dir, tmp_path, devices: list[str], placement: str, warmup: dict | None = None) -> ServerThread:
    cfg = Config.model_validate({
        "model": {"dir": str(tiny_dir), "devices": devices, "placement": placement},
        "speakers": {"dir": str(tmp_path / "spk")},
        "server": {"port": 0, "metrics_port": 0, "grace_seconds": 5},
        "warmup": warmup or {},
    })
    return ServerThread(cfg, ready_timeout=900)


async def _speak(target: str, n: int, **kwargs) -> list[np.ndarray]:
    """n concurrent streamed syntheses; the audio of each."""
    async with CosyVoiceClient(target) as client:
        async def one() -> np.ndarray:
            chunks = [c async for c in client.synthesize(TEXT, stream=True, encoding="float32", max_tokens=60,
                                                         **kwargs)]
            assert chunks and chunks[-1].is_final
            return np.concatenate([chunk_samples(c) for c in chunks])
        return await asyncio.gather(*(one() for _ in range(n)))


def _same_audio(audio: list[np.ndarray]) -> None:
    """One seed, one voice: the same tokens on any device, so the same length and nearly the same
    audio (batched flow sums floats in another order; HiFT's phase amplifies that, see
    token2wav.Token2WavRunner)."""
    for a in audio[1:]:
        assert a.shape == audio[0].shape
        assert np.corrcoef(a, audio[0])[0, 1] > 0.95


def _device_metric(st: ServerThread, name: str) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=10).read().decode()
    found = re.findall(rf'^{name}{{device="([^"]+)",index="(\d)",role="([^"]+)"}} ([0-9.e+]+)$', text, re.M)
    return {(index, role): float(value) for _device, index, role, value in found}


def test_replicas_share_speakers_and_balance_requests(tiny_dir, tmp_path, golden_dir):
    # warm-up coverage forced (as on a GPU): the capture plan on every replica, and a registration
    # prepares the speaker's flow prefix on every replica
    with _server(tiny_dir, tmp_path, ["cpu", "cpu"], "replicas", warmup={"coverage": True}) as st:
        router = st.server.synthesizer
        assert isinstance(router, ReplicaRouter) and len(router.replicas) == 2
        prompt = (golden_dir / "prompt_24k.wav").read_bytes()

        async def register():
            async with CosyVoiceClient(st.target) as client:
                await client.register_speaker("shared_voice", PROMPT_TEXT, prompt)

        def prefixes(speaker_id: str = "shared_voice") -> list[bool]:  # its flow prompt prefix, per replica
            return [speaker_id in r.synth.batcher.runner.speaker_prefixes for r in router.replicas]

        assert prefixes("tiny_zs_spk") == [True, True]  # the model directory's zero-shot speaker: at start

        st.call(register(), timeout=300)
        assert prefixes() == [True, True]  # its flow prompt prefix is on both replicas before any request
        served_before = [r.served for r in router.replicas]
        # same seed on both replicas: the same audio wherever a request lands
        audio = st.call(_speak(st.target, 4, mode="zero_shot_by_spk_id", speaker_id="shared_voice", seed=5),
                        timeout=600)
        served = [r.served - b for r, b in zip(router.replicas, served_before)]
        assert served == [2, 2], served  # 4 concurrent requests: least-loaded routing alternates
        _same_audio(audio)
        assert all(r.active == 0 for r in router.replicas)
        assigned = _device_metric(st, "cosyvoice_device_assigned_total")
        assert assigned == {("0", "replica"): served_before[0] + 2, ("1", "replica"): served_before[1] + 2}
        # each replica's token2wav reports its CUDA graph state (a CPU captures none)
        assert _device_metric(st, "cosyvoice_device_cuda_graph_background_captures_total") == {
            ("0", "replica"): 0.0, ("1", "replica"): 0.0}

        # the benchmark client against the two-replica server
        before = [r.served for r in router.replicas]
        out = tmp_path / "bench.json"
        code = cli_main(["bench", "--target", st.target, "--concurrency", "2", "--requests", "4", "--tokens", "20",
                         "--prompt-seconds", "1", "--no-warmup", "--quiet", "--no-plots", "--out", str(out)])
        (level,) = json.loads(out.read_text())["levels"]
        assert code == 0 and level["errors"] == 0 and level["requests"] == 4
        assert all(r.served > b for r, b in zip(router.replicas, before))  # both replicas took bench requests

        # replica 0 stops under load: its streams end with UNAVAILABLE, replica 1's finish, later
        # requests (with the speaker registered before) go to replica 1, and the server stays up
        async def stop_one_under_load() -> list[str]:
            async with CosyVoiceClient(st.target) as client:
                async def one(started: asyncio.Event) -> str:
                    try:
                        async for _ in client.synthesize(TEXT, stream=True, max_tokens=100, speaker_id="shared_voice",
                                                         mode="zero_shot_by_spk_id"):
                            started.set()
                        return "OK"
                    except grpc.aio.AioRpcError as e:
                        return e.code().name
                started = [asyncio.Event() for _ in range(4)]
                streams = [asyncio.create_task(one(e)) for e in started]
                await asyncio.gather(*(e.wait() for e in started))
                await router.replicas[0].synth.close()
                return await asyncio.gather(*streams)

        assert sorted(st.call(stop_one_under_load(), timeout=600)) == ["OK", "OK", "UNAVAILABLE", "UNAVAILABLE"]
        before = [r.served for r in router.replicas]
        st.call(_speak(st.target, 2, mode="zero_shot_by_spk_id", speaker_id="shared_voice"), timeout=600)
        assert [r.served - b for r, b in zip(router.replicas, before)] == [0, 2]
        assert router.ready and all(r.active == 0 for r in router.replicas)

        async def register_late():  # with replica 0 stopped: registered on replica 1 alone
            async with CosyVoiceClient(st.target) as client:
                await client.register_speaker("late_voice", PROMPT_TEXT, prompt)
        st.call(register_late(), timeout=300)
        assert "late_voice" in router.replicas[1].synth.batcher.runner.speaker_prefixes
        st.call(_speak(st.target, 1, mode="zero_shot_by_spk_id", speaker_id="late_voice"), timeout=600)
        st.call(router.delete_speaker("late_voice"), timeout=60)

        # deleting the speaker drops its cached flow prompt prefix on every replica
        assert prefixes() == [True, True]

        async def delete():
            async with CosyVoiceClient(st.target) as client:
                await client.delete_speaker("shared_voice")
        st.call(delete(), timeout=60)
        assert prefixes() == [False, False]


MODEL_CLASSES = (CosyVoice2LM, Flow, HiFT)


def _live_models() -> list[int]:
    """How many LM, flow and HiFT modules are alive in this process. The warm-up freezes the heap
    (warmup.settle_heap), and gc.get_objects() does not list frozen objects: unfrozen first."""
    gc.unfreeze()
    gc.collect()
    objects = gc.get_objects()
    return [sum(isinstance(o, cls) for o in objects) for cls in MODEL_CLASSES]


def test_disaggregated_streams_spread_over_token2wav_workers(tiny_dir, tmp_path, golden_dir):
    before_load = _live_models()
    with _server(tiny_dir, tmp_path, ["cpu", "cpu", "cpu"], "disaggregated") as st:
        synth = st.server.synthesizer
        pool = synth.batcher
        assert isinstance(pool, Token2WavPool) and len(pool.workers) == 2  # devices[0] runs the LLM only
        # what each device holds: the LM alone on the first, flow + HiFT on each other; and
        # nothing else was loaded (no flow or HiFT built for the LM device and left behind)
        held = [{type(m).__name__ for m in synth.models if m is not None},
                *({type(w.batcher.runner.flow).__name__, type(w.batcher.runner.hift).__name__} for w in pool.workers)]
        assert held == [{"CosyVoice2LM"}, {"Flow", "HiFT"}, {"Flow", "HiFT"}], held
        assert [n - b for n, b in zip(_live_models(), before_load)] == [1, 2, 2]
        assert [s.role for s in device_stats(synth)] == ["llm", "token2wav", "token2wav"]
        prompt = (golden_dir / "prompt_24k.wav").read_bytes()
        before = [w.served for w in pool.workers]
        audio = st.call(_speak(st.target, 4, mode="cross_lingual", prompt_audio=prompt, seed=7), timeout=600)
        served = [w.served - b for w, b in zip(pool.workers, before)]
        assert served == [2, 2], served
        assert all(w.open_streams == 0 and w.batcher.open_streams == 0 for w in pool.workers)  # every stream ended
        _same_audio(audio)
        assigned = _device_metric(st, "cosyvoice_device_assigned_total")
        assert assigned[("1", "token2wav")] == before[0] + 2 and assigned[("2", "token2wav")] == before[1] + 2
        # the token2wav devices report their CUDA graph state, the LLM's does not
        assert _device_metric(st, "cosyvoice_device_cuda_graph_background_captures_total") == {
            ("1", "token2wav"): 0.0, ("2", "token2wav"): 0.0}

        async def register():  # a registered speaker's flow prompt prefix is on every worker at once
            async with CosyVoiceClient(st.target) as client:
                await client.register_speaker("pooled_voice", PROMPT_TEXT, prompt)
        st.call(register(), timeout=300)
        assert ["pooled_voice" in w.batcher.runner.speaker_prefixes for w in pool.workers] == [True, True]
