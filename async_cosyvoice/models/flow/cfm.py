"""CausalConditionalCFM: Euler integration of the estimator from fixed noise, with classifier-free guidance."""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch import Tensor, nn

from ..dims import CFMParams

Estimator = Callable[..., Tensor]  # (x, mask, mu, t, spks, cond, streaming) -> v


@functools.lru_cache(maxsize=None)
def fixed_noise(channels: int, frames: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The flow's starting noise: CPU seed 0, randn(1, channels, frames). Shared: never modify in place.

    Every call indexes it from frame 0 of prompt + target, which is what keeps a streaming chunk
    consistent with the frames rendered before it.
    """
    noise = torch.randn(1, channels, frames, generator=torch.Generator().manual_seed(0))
    return noise.to(device=device, dtype=dtype)


def time_grid(n_steps: int, scheduler: str, device=None) -> Tensor:
    """n_steps + 1 float32 times from 0 to 1."""
    t = torch.linspace(0, 1, n_steps + 1, device=device)
    if scheduler == "cosine":
        t = 1 - torch.cos(t * 0.5 * math.pi)
    return t


class CausalConditionalCFM(nn.Module):
    """The ODE solver around a vector-field estimator: CosyVoice2's U-Net (estimator.py) or
    CosyVoice3's DiT (cosyvoice3/dit.py). Both take (x, mask, mu, t, spks, cond, streaming) and,
    for a cached call, `cache=(cursor, geometry)`."""

    def __init__(self, estimator: nn.Module, params: CFMParams):
        super().__init__()
        self.params = params
        self.estimator = estimator

    def forward(
        self,
        mu: Tensor,
        mask: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool | Tensor = False,
        estimator: Estimator | None = None,
        trace: dict | None = None,
    ) -> Tensor:
        """mu, cond (B, 80, T); mask (B, 1, T); spks (B, 80) -> mel (B, 80, T) float32, zero where masked.

        `estimator` replaces the module's own (an ONNX / TensorRT / compiled backend with the same
        signature). Each step is one estimator call of batch 2B: [conditional; unconditional], the
        unconditional half with mu, spks and cond zeroed.
        """
        estimator = self.estimator if estimator is None else estimator
        B, C, T = mu.shape
        if T > self.params.noise_frames:
            raise ValueError(f"{T} mel frames (prompt + target) exceed the {self.params.noise_frames} frames of flow noise")
        x = fixed_noise(C, self.params.noise_frames, mu.device, mu.dtype)[:, :, :T].expand(B, C, T)
        if isinstance(streaming, Tensor):
            streaming = streaming.reshape(-1).expand(B).repeat(2)
        return self._integrate(x, mu, mask, spks, cond, lambda step, *args: estimator(*args, streaming), trace)

    def forward_cached(self, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, g,
                       step_cursor: Callable[[int], object], step_done: Callable[[int, object], None]) -> Tensor:
        """A cached streaming call (prefix.py): mu, cond (B, 80, N) and mask (B, 1, N) hold frames
        [start, end) of each item of `g` (a Geometry or SlotGeometry). step_cursor(step) gives the
        cursor over the items' estimator state at that CFM step (1-based); step_done(step, cursor)
        is called after the step's estimator call (the module's own PyTorch estimator; the state
        pool runs a copy of the flow whose blocks are compiled, token2wav/slot_regions.py)."""
        C = mu.shape[1]
        if g.K > self.params.noise_frames:
            raise ValueError(f"{g.K} mel frames (prompt + target) exceed the {self.params.noise_frames} frames of flow noise")
        noise = fixed_noise(C, self.params.noise_frames, mu.device, mu.dtype)[0]
        # the noise at each item's absolute frames (padding frames clamp to a valid one; masked anyway)
        x = noise[:, g.positions().clamp(max=self.params.noise_frames - 1)].permute(1, 0, 2)

        def step_fn(step, x2, mask2, mu2, t2, spks2, cond2):
            cursor = step_cursor(step)
            v = self.estimator(x2, mask2, mu2, t2, spks2, cond2, cache=(cursor, g))
            step_done(step, cursor)
            return v

        return self._integrate(x, mu, mask, spks, cond, step_fn)

    def _integrate(self, x: Tensor, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, estimator,
                   trace: dict | None = None) -> Tensor:
        """Euler steps from x; estimator(step, x2, mask2, mu2, t2, spks2, cond2) -> v for the 2B rows."""
        p = self.params
        B = mu.shape[0]
        mask2 = torch.cat([mask, mask])
        mu2 = torch.cat([mu, torch.zeros_like(mu)])
        spks2 = torch.cat([spks, torch.zeros_like(spks)])
        cond2 = torch.cat([cond, torch.zeros_like(cond)])
        r = p.inference_cfg_rate

        t_span = time_grid(p.n_timesteps, p.t_scheduler, mu.device)
        # t advances by dt (not read from the grid) to follow the reference's float rounding
        t, dt = t_span[0], t_span[1] - t_span[0]
        ts = []
        for step in range(1, p.n_timesteps + 1):
            x2, t2 = torch.cat([x, x]), t.expand(2 * B).to(mu.dtype)
            v = estimator(step, x2, mask2, mu2, t2, spks2, cond2)
            if trace is not None and step == 1:
                trace.update(est_step1_in_x=x2, est_step1_in_mask=mask2, est_step1_in_mu=mu2, est_step1_in_t=t2,
                             est_step1_in_spks=spks2, est_step1_in_cond=cond2, est_step1_out=v)
            v_cond, v_uncond = v.chunk(2)
            x = x + dt * ((1.0 + r) * v_cond - r * v_uncond)
            ts.append(t)
            t = t + dt
            if step < p.n_timesteps:
                dt = t_span[step + 1] - t
        if trace is not None:
            trace[f"est_step{p.n_timesteps}_out"] = v
            trace["est_t_per_step"] = torch.stack(ts)
        return (x * mask).float()  # padding frames would still hold noise
