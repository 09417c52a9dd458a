"""HiFT over the chunks of many streams at once: one call per group of items, run as one CUDA graph
per (items, frames) bucket.

A streaming chunk's HiFT call (8 cached mel frames + the chunk's, its cache_source) launches about
a thousand kernels from Python; streams' chunks have different lengths, and HiFT is not causal, so
before this a batch of N streams made one such call per distinct length. `render_group` runs a
group of items of different lengths as one right-padded call (`HiFT.inference_padded`: masks make
each item its own call, up to float summation order), and with `HiFTGraphs` that call is one
`graph.replay()` of `HiFT.render_padded` in its bucket; the NSF draws (each stream's own
generator, at its own length) are made before the replay.

Buckets: B items of at most T frames take the smallest item bucket >= B and T rounded up like the
estimator's lengths (`length_bucket`, steps of >= `min_frame_step` frames: <= 12.5 % padding), for
buckets of at most `max_bucket_frames` (items x frames); larger calls run eagerly. Extra rows are
zero-length items (all masked). A bucket's first call runs padded without a graph; its graph is
captured by the token2wav stage's capture thread (graph_buckets.GraphBuckets.capture_wanted; `warmup`
captures chosen ones ahead). Graphs share one memory pool (graph_buckets.py, as the flow's). Off CUDA (`cuda_graphs=False`) the same padded call
runs without a graph, which the tests use to check that bucket padding changes nothing.

CosyVoice3's CausalHiFT takes the same buckets (`render_causal`): each stream re-vocodes all its
mel so far, final or not, and `CausalHiFT.render_padded` (a final call per item: what a non-final
item emits is the same) is what runs in the bucket's graph, its inputs the masked mel, the lengths
and the vocoder's fixed NSF draws (one row for every item: each starts at the buffer's sample 0).
It has no source cache (cache_samples=0).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..graph_buckets import DEFAULT_STREAM_BUCKETS, Bucket, GraphBuckets
from ..models.cosyvoice3.hift import CausalHiFT
from ..models.hift import HiFT, NSFNoise

HiFTOutput = tuple[Tensor, Tensor]  # speech (1, 480T), source (1, 1, 480T) of one item


# GraphBuckets.cover for HiFT: on the H200 its graph of 16 streams' chunks took 28 ms (~17 us a stream-frame) and
# a first chunk 3.6 ms in a graph against 11.0 ms eager, so 512 extra frames (~9 ms) about what a small call
# loses without its graph. Not measured as such.
DEFAULT_COVER_FRAMES = 512


class HiFTGraphs(GraphBuckets):
    """Runs a vocoder's padded call in its bucket's graph, or, past the buckets, eagerly:
    CosyVoice2's HiFT through `__call__` (`HiFT.inference_padded`'s signature), CosyVoice3's
    CausalHiFT through `render_causal` (`CausalHiFT.render`'s padded_call)."""
    what, unit = "HiFT", "frames"

    def __init__(self, hift: HiFT | CausalHiFT, *, cache_samples: int, cuda_graphs: bool | None = None,
                 stream_buckets: Sequence[int] = DEFAULT_STREAM_BUCKETS, min_frame_step: int = 16,
                 max_bucket_frames: int = 8192, max_graphs: int = 128, max_cover_frames: int = DEFAULT_COVER_FRAMES):
        """cache_samples: the longest cache_source a graph takes (the streams' source cache; 0 for
        CausalHiFT, which takes none); max_cover_frames: the most streams x frames a larger bucket's
        graph may add to a call whose bucket waits for its capture (GraphBuckets.cover)."""
        if isinstance(hift, CausalHiFT) and cache_samples:
            raise ValueError("CausalHiFT takes no cache_source: cache_samples must be 0")
        # a bucket holds the longest cache: at least that many frames
        super().__init__(next(hift.parameters()).device, cuda_graphs=cuda_graphs, batch_buckets=stream_buckets,
                         min_step=min_frame_step, max_bucket_size=max_bucket_frames, max_graphs=max_graphs,
                         min_length=-(-cache_samples // hift.upsample_scale), max_cover_extra=max_cover_frames)
        self.hift = hift
        self.cache_samples = cache_samples

    @torch.inference_mode()
    def __call__(self, mel: Tensor, lengths: Sequence[int], noise: Sequence[NSFNoise | None],
                 cache_source: Sequence[Tensor | None] | None = None) -> tuple[Tensor, list[Tensor]]:
        """HiFT.inference_padded of right-padded items: speech (B, 480T') with T' >= max(lengths),
        and each item's source (1, 1, 480·lengths[b])."""
        if isinstance(self.hift, CausalHiFT):
            raise TypeError("a CausalHiFT's graphs run through render_causal")
        B = mel.shape[0]
        caches = list(cache_source) if cache_source is not None else [None] * B
        bucket = self.bucket(B, max(lengths))
        if bucket is None or any(c is not None and c.shape[-1] > self.cache_samples for c in caches):
            self.fallbacks += 1
            return self.hift.inference_padded(mel, lengths, noise, caches)
        speech, source = self._run(bucket, self.hift.padded_inputs(mel[:, :, :max(lengths)], lengths, noise, caches))
        # clones: the next replay (of any graph in the pool) overwrites the outputs
        scale = self.hift.upsample_scale
        return speech[:B].clone(), [source[b:b + 1, :, :scale * n].clone() for b, n in enumerate(lengths)]

    @torch.inference_mode()
    def render_causal(self, mel: Tensor, lengths: Sequence[int]) -> Tensor:
        """CausalHiFT.render_padded of right-padded items (CausalHiFT.render's padded_call): speech
        (B, 480T') with T' >= max(lengths), in the bucket's graph or, past the buckets, eagerly."""
        if not isinstance(self.hift, CausalHiFT):
            raise TypeError("render_causal runs CosyVoice3's CausalHiFT; HiFT's graphs run through __call__")
        B, T = mel.shape[0], max(lengths)
        group = self.items_per_call(T)
        if B > group:  # a group per call: a bucket's graph, or an eager call of bounded memory
            width = self.hift.upsample_scale * T
            parts = [self.render_causal(mel[i:i + group], lengths[i:i + group]) for i in range(0, B, group)]
            return torch.cat([torch.nn.functional.pad(p[:, :width], (0, width - min(width, p.shape[1])))
                              for p in parts])
        inputs = self.hift.padded_inputs(mel[:, :, :T], lengths)
        bucket = self.bucket(B, T)
        if bucket is None:
            self.fallbacks += 1
            return self.hift.render_padded(**inputs)
        return self._run(bucket, inputs)[:B].clone()  # the next replay overwrites the output

    def items_per_call(self, frames: int) -> int:
        """How many items of `frames` one call takes: the largest stream bucket whose bucket fits
        max_bucket_frames (at least 1). CausalHiFT re-renders all the mel so far, so 64 streams 10 s
        in make one call of 64 x 1000 frames: split, it runs in graphs and its activations stay
        bounded (an eager call that size ran an 80 GB card out of memory)."""
        fits = [b for b in self.batch_buckets if self._bucket_of(b, frames) is not None]
        return max(fits, default=1)

    # -- GraphBuckets

    def _fn(self, bucket: Bucket):
        return self.hift.render_padded

    def _buffer_shape(self, name: str, bucket: Bucket, example: Tensor) -> tuple[int, ...]:
        Bb, Tb = bucket
        if name == "mel":
            return Bb, example.shape[1], Tb
        if name == "sine_noise":
            return Bb, self.hift.upsample_scale * Tb, example.shape[2]
        if name == "cache":
            return Bb, 1, self.cache_samples
        if name == "fixed_noise":  # CausalHiFT's: one row for every item
            return 1, self.hift.upsample_scale * Tb, example.shape[2]
        if name == "fixed_phases":
            return tuple(example.shape)
        return (Bb,) + tuple(example.shape[1:])

    def _example(self, bucket: Bucket) -> dict[str, Tensor]:
        Bb, Tb = bucket
        mel = torch.zeros(Bb, self.hift.dims.in_channels, Tb, device=self.device)
        if isinstance(self.hift, CausalHiFT):
            return self.hift.padded_inputs(mel, [Tb] * Bb)
        return self.hift.padded_inputs(mel, [Tb] * Bb, [NSFNoise.zero()] * Bb)


def render_group(hift: HiFT | CausalHiFT, graphs: HiFTGraphs | None, mels: Sequence[Tensor],
                 caches: Sequence[Tensor | None], noise: Sequence[NSFNoise | None],
                 finalize: Sequence[bool] | None = None) -> list[HiFTOutput]:
    """HiFT of one group of items, mel (1, 80, T_b) each, with their cache_source (1, 1, S) or None
    and NSF noise: in a graph where `graphs` has a bucket for it, else one plain batched call when
    the lengths are equal, else one padded call. Items too short to pad (< 2 frames: HiFT's
    reflection needs 2) run alone. Returns (speech (1, 480T_b), source (1, 1, 480T_b)) per item.

    CosyVoice3's CausalHiFT (its NSF noise is its own, it takes no cache_source) renders each item
    final or not (`finalize`, required for it; `CausalHiFT.render`: the whole group in one padded,
    exact call, in a graph where `graphs` has a bucket for it); its source comes back empty."""
    if isinstance(hift, CausalHiFT):
        if finalize is None:
            raise ValueError("a CausalHiFT group needs each item's finalize flag")
        padded_call = graphs.render_causal if graphs is not None else None
        return [(speech, speech.new_zeros(1, 1, 0)) for speech in hift.render(list(mels), list(finalize), padded_call)]
    frames = [m.shape[2] for m in mels]
    out: list[HiFTOutput | None] = [None] * len(mels)
    short = [i for i, n in enumerate(frames) if n < 2]
    for i in short:
        m = mels[i]
        out[i] = (m.new_zeros(1, 0), m.new_zeros(1, 1, 0)) if frames[i] == 0 else \
            hift.inference(m, caches[i], noise[i] or NSFNoise())
    rest = [i for i, n in enumerate(frames) if n >= 2]
    if not rest:
        return out  # type: ignore[return-value]
    rest_frames = [frames[i] for i in rest]
    rest_noise = [noise[i] or NSFNoise() for i in rest]
    rest_caches = [caches[i] for i in rest]
    if graphs is None and len(set(rest_frames)) == 1:  # equal lengths: the plain batched call
        mel = torch.cat([mels[i] for i in rest])
        if len(rest) == 1:
            speech, source = hift.inference(mel, rest_caches[0], rest_noise[0])
        else:
            speech, source = hift.inference(mel, rest_caches, rest_noise)
        sources = [source[k:k + 1] for k in range(len(rest))]
    else:
        mel = mels[rest[0]].new_zeros(len(rest), mels[rest[0]].shape[1], max(rest_frames))
        for k, i in enumerate(rest):
            mel[k, :, :frames[i]] = mels[i][0]
        run = graphs if graphs is not None else hift.inference_padded
        speech, sources = run(mel, rest_frames, rest_noise, rest_caches)
    for k, i in enumerate(rest):
        out[i] = (speech[k:k + 1, :hift.upsample_scale * frames[i]], sources[k])
    return out  # type: ignore[return-value]

