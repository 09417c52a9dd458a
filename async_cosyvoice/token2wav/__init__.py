"""Speech tokens -> 24 kHz audio, batched across streams.

- `schedule`: ChunkSchedule and the adaptive hop (pure arithmetic)
- `stream`: Token2WavStream, one segment's plan and HiFT carry; Token2WavJob, one chunk's work
- `runner`: Token2WavRunner, the device half (flow through the exact cache or padded groups, HiFT)
- `flow_cache`, `flow_graphs`, `hift_graphs`: the cache's arithmetic and speaker prefixes; graphs
- `batcher`, `offline`, `offline_batcher`: the per-device asyncio batcher and its offline lane
- `stage`, `process`: Config -> runner + batcher; the same stage in a child process
"""
from .runner import ChunkRecord, RunnerStats, Token2WavRunner, length_groups
from .schedule import ChunkSchedule, adaptive_hop
from .stream import FlowLike, Token2WavJob, Token2WavStream, crossfade, request_noise

__all__ = [
    "ChunkSchedule", "adaptive_hop", "Token2WavJob", "Token2WavStream", "FlowLike", "crossfade",
    "request_noise", "Token2WavRunner", "ChunkRecord", "RunnerStats", "length_groups",
]
