"""token2wav in a child process (`token2wav.process`, token2wav/process.py), on CPU with the tiny
model: the same audio as in-process (streamed and not), a cancelled request drops its job and the
child keeps serving, and the child's death ends requests with UNAVAILABLE, turns health
NOT_SERVING and makes the server exit with code 3."""
from __future__ import annotations

import asyncio
import os
import signal

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from async_cosyvoice.config import Config
from async_cosyvoice.errors import EngineDead
from async_cosyvoice.frontend.audio import load_audio
from async_cosyvoice.placement import Token2WavPool, create_synthesizer
from async_cosyvoice.request import Mode, SynthesisOptions, SynthesisRequest
from async_cosyvoice.speakers import SpeakerStore
from async_cosyvoice.token2wav.process import Token2WavProcess
from async_cosyvoice.tts import Synthesizer
from async_cosyvoice.warmup import capture_plan
from grpc_async.client import CosyVoiceClient, collect
from grpc_async.server import ENGINE_DEAD_EXIT_CODE, ServerThread

pytestmark = pytest.mark.slow

TEXT = "Hello there, this is a small test of the token2wav process."
TRANSCRIPT = "The morning train was late again."


def make_config(tiny_dir, tmp_path, process: bool, **server) -> Config:
    return Config.model_validate({
        "model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(tmp_path / "spk")},
        "token2wav": {"process": process, "adaptive": False},  # chunk sizes by the schedule alone, not by timing
        "server": {"port": 0, "metrics_port": 0, "grace_seconds": 2, **server}})


def request(tiny_dir, stream: bool, max_tokens: int = 80) -> SynthesisRequest:
    return SynthesisRequest(Mode.ZERO_SHOT, text=TEXT, prompt_text=TRANSCRIPT,
                            prompt_audio=load_audio(tiny_dir / "golden" / "prompt_24k.wav"),
                            options=SynthesisOptions(stream=stream, seed=7, max_tokens=max_tokens))


async def render(synth: Synthesizer, req: SynthesisRequest) -> list[np.ndarray]:
    return [np.asarray(c.samples) async for c in synth.synthesize(req)]


def test_same_audio_as_in_process_and_cancellation(tiny_dir, tmp_path):
    async def run(process: bool):
        synth = await Synthesizer.create(make_config(tiny_dir, tmp_path, process), warmup=False)
        try:
            out = {stream: await render(synth, request(tiny_dir, stream)) for stream in (True, False)}
            if process:
                proc = synth.batcher
                assert isinstance(proc, Token2WavProcess) and proc.process.is_alive()
                assert synth.models.flow is None and synth.models.hift is None  # loaded in the child only
                assert proc.stage_stats.calls > 0 and proc.stage_stats.items >= len(out[True])
                # a cancelled request: its pending job is dropped, the child keeps serving
                # the device's open streams are counted on this side, where segments run
                chunks = synth.synthesize(request(tiny_dir, True, max_tokens=400))
                async for _ in chunks:
                    assert proc.open_streams == 1
                    break
                await chunks.aclose()
                assert proc._pending == {} and proc.open_streams == 0
                # every reply carries the child's CUDA graph state (none captured on a CPU)
                assert proc.graph_state is not None and proc.graph_state.graphs == proc.graph_state.wanted == 0
                out["after cancel"] = await render(synth, request(tiny_dir, True))
                assert proc.open_streams == 0
            return out
        finally:
            await synth.close()

    ref = asyncio.run(run(False))
    got = asyncio.run(run(True))
    for stream in (True, False):
        assert [len(c) for c in got[stream]] == [len(c) for c in ref[stream]]
        a, b = np.concatenate(got[stream]), np.concatenate(ref[stream])
        # the same computation in another process (its own torch threads: float summation order)
        assert np.abs(a - b).max() < 1e-3 and np.corrcoef(a, b)[0, 1] > 0.999
    assert [len(c) for c in got["after cancel"]] == [len(c) for c in got[True]]


def test_child_death_ends_requests_and_the_server(tiny_dir, tmp_path):
    SpeakerStore(tmp_path / "spk").import_spk2info(tiny_dir / "spk2info.pt")
    st = ServerThread(make_config(tiny_dir, tmp_path, True), ready_timeout=600)
    proc = st.server.synthesizer.batcher
    assert isinstance(proc, Token2WavProcess)

    async def body():
        async with CosyVoiceClient(st.target) as c, grpc.aio.insecure_channel(st.target) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            inflight = c.synthesize("Hello there.", speaker_id="tiny_zs_spk", seed=1, stream=True, max_tokens=3000)
            async for chunk in inflight:
                if chunk.num_samples:
                    break
            os.kill(proc.process.pid, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in inflight:
                    pass
            inflight_error = (e.value.code(), e.value.details())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(c.synthesize("Hi.", mode="sft", speaker_id="tiny_sft_spk"))
            return inflight_error, (e.value.code(), e.value.details())

    try:
        inflight, new = asyncio.run(body())
        assert st.call(st.server.serve_until(asyncio.Event()), timeout=60) == ENGINE_DEAD_EXIT_CODE
        with pytest.raises(EngineDead, match="token2wav process on cpu exited"):
            st.call(proc.capture_graphs(capture_plan(Config())), timeout=30)
    finally:
        st.close(grace=0)
    for code, details in (inflight, new):
        assert code == grpc.StatusCode.UNAVAILABLE, details
        assert "token2wav process on cpu exited (exit code -9)" in details


def test_disaggregated_workers_in_processes(tiny_dir, tmp_path):
    """placement disaggregated with token2wav.process: the LLM here, a child process per other device."""
    config = Config.model_validate({
        "model": {"dir": str(tiny_dir), "devices": ["cpu", "cpu", "cpu"], "placement": "disaggregated"},
        "speakers": {"dir": str(tmp_path / "spk")}, "token2wav": {"process": True, "adaptive": False}})

    async def run():
        synth = await create_synthesizer(config, warmup=False)
        try:
            pool = synth.batcher
            assert isinstance(pool, Token2WavPool)
            assert all(isinstance(w.batcher, Token2WavProcess) for w in pool.workers)
            pids = {w.batcher.process.pid for w in pool.workers}
            assert len(pids) == 2 and os.getpid() not in pids
            audio = await asyncio.gather(*(render(synth, request(tiny_dir, True)) for _ in range(2)))
            # a registration computes the speaker's flow prompt prefix in each child (a call of no jobs)
            calls = [w.batcher.stage_stats.calls for w in pool.workers]
            record = await synth.register_speaker("proc_voice", TRANSCRIPT, load_audio(tiny_dir / "golden" / "prompt_24k.wav"))
            assert [w.batcher.stage_stats.calls - c for w, c in zip(pool.workers, calls)] == [1, 1]
            voice = record.voice
            assert await pool.prepare_speaker(torch.from_numpy(voice.speech_tokens.copy())[None],
                                              torch.from_numpy(voice.speech_feat.copy())[None],
                                              torch.from_numpy(voice.embedding.copy())[None], "proc_voice")
            return audio, [w.served for w in pool.workers]
        finally:
            await synth.close()

    audio, served = asyncio.run(run())
    assert served == [1, 1]  # one stream on each worker process
    assert [len(c) for c in audio[0]] == [len(c) for c in audio[1]] and len(audio[0]) > 1
