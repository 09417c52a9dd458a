"""Qwen2 decoder stack (the CosyVoice2 LM backbone) with an explicit slot KV cache.

Parameter names match HF `Qwen2Model` (`embed_tokens`, `layers.{i}.self_attn.q_proj`, ...), so
the official weights load with only the `llm.model.model.` prefix stripped. Inside, q/k/v and
gate/up are packed into one GEMM each (`qkv_proj`, `gate_up_proj`, as nano-vllm and vLLM do): a
decode step is launch-bound, and one wide GEMM is cheaper than three narrow ones. Loading packs
the checkpoint's separate tensors and `state_dict()` splits them again, so the names a checkpoint
sees never change (`PackedLinear`, `keep_checkpoint_names`).

The cache is driven by the caller: every forward gets `positions` [B, T] and `slots` [B]; the
k/v of token (b, t) are written at (slots[b], positions[b, t]) and the token attends to the cache
positions <= its own position of its own slot. Everything is shaped by (B, T, kv_len) only, so a
B x 1 decode step has static shapes and can be captured in a CUDA graph. A position of -1 marks
padding (a padded prefill of several sequences): its k/v go to a scratch slot nobody reads.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dims import Qwen2Dims


class KVCache:
    """Preallocated k/v for `num_slots` sequences of up to `max_len` positions each.

    k[layer], v[layer]: [num_slots + 1, num_kv_heads, max_len, head_dim]; the extra last slot is
    the scratch slot that absorbs the writes of padding tokens. One tensor per layer rather than
    views of one: the layers then see identical inputs (torch.compile shares one compiled layer).
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (num_slots + 1, num_kv_heads, max_len, head_dim)
        # zeros, not empty: masked-out positions are still multiplied by 0 in attention, and 0 * NaN = NaN
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, dims: Qwen2Dims, num_slots: int, max_len: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> "KVCache":
        return cls(dims.num_layers, num_slots, max_len, dims.num_kv_heads, dims.head_dim, dtype, device)

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0] - 1

    @property
    def scratch_slot(self) -> int:
        return self.k[0].shape[0] - 1

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # HF op order: normalise in float32, cast back, then scale
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


@functools.lru_cache(maxsize=None)
def _inv_freq(head_dim: int, theta: float, device: torch.device) -> Tensor:
    # not a module buffer: `model.to(bfloat16)` would round it
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [B, T, 1, head_dim] for the HF rotate_half convention (frequencies repeated twice)."""
    freqs = positions[..., None].float() * _inv_freq(head_dim, theta, positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + rotate_half(x) * sin


class PackedLinear(nn.Linear):
    """Several projections of one input as one GEMM; `forward` returns the parts' outputs.

    `parts` maps each checkpoint name (`q_proj`, `k_proj`, ...) to its output width, in packing
    order. The parent module calls `keep_checkpoint_names(self, name)` so that its state dict
    shows the parts as the separate sibling linears of the checkpoint.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return super().forward(x).split(list(self.parts.values()), dim=-1)

    def tensor_names(self) -> list[str]:
        return ["weight"] + (["bias"] if self.bias is not None else [])


def keep_checkpoint_names(parent: nn.Module, packed: str) -> None:
    """`parent.load_state_dict` concatenates `{part}.weight` (and `.bias`) of the PackedLinear
    child `packed` into its rows; `parent.state_dict()` slices them out again. A state dict holding
    only some of the parts is left alone, so strict loading reports it as it stands. The hooks sit
    on the parent: its own load checks for unexpected keys before any child's hook runs."""
    def pack(owner: nn.Module, state_dict, prefix, *args) -> None:
        module: PackedLinear = getattr(owner, packed)
        for tensor in module.tensor_names():
            keys = [f"{prefix}{part}.{tensor}" for part in module.parts]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{packed}.{tensor}"] = torch.cat([state_dict.pop(k) for k in keys])

    def split(owner: nn.Module, state_dict, prefix, local_metadata) -> None:
        module: PackedLinear = getattr(owner, packed)
        for tensor in module.tensor_names():
            pieces = state_dict.pop(f"{prefix}{packed}.{tensor}").split(list(module.parts.values()))
            for part, piece in zip(module.parts, pieces):
                state_dict[f"{prefix}{part}.{tensor}"] = piece

    parent.register_load_state_dict_pre_hook(pack)
    parent.register_state_dict_post_hook(split)


class Attention(nn.Module):
    def __init__(self, dims: Qwen2Dims):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        h, q, kv = dims.hidden_size, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(h, {"q_proj": q, "k_proj": kv, "v_proj": kv}, bias=True)
        self.o_proj = nn.Linear(q, h, bias=False)
        keep_checkpoint_names(self, "qkv_proj")

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                cache: tuple[Tensor, Tensor] | None = None, write: tuple[Tensor, Tensor] | None = None,
                read: tuple[Tensor, int] | None = None) -> Tensor:
        """x [B, T, H]; mask [B, 1, T, S] (True = attend). With a cache, k/v are written at
        `write` = (slot [B, T], position [B, T]) and read back as the first `read[1]` positions
        of slots `read[0]` [B]; without, the keys are the T tokens of x."""
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x)
        q = apply_rope(q.reshape(B, T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(k.reshape(B, T, self.n_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(B, T, self.n_kv_heads, self.head_dim)
        if cache is None:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        else:
            k_cache, v_cache = cache
            slot, pos = write
            k_cache[slot, :, pos] = k  # [B, T] indices around a slice: values are [B, T, n_kv, D]
            v_cache[slot, :, pos] = v
            slots, kv_len = read
            k, v = k_cache[slots, :, :kv_len], v_cache[slots, :, :kv_len]
        # GQA without copying k/v: the `group` query heads that share a kv head become extra query
        # rows of that head (HF repeat_kv order: query head h reads kv head h // group)
        group = self.n_heads // self.n_kv_heads
        q = q.view(B, T, self.n_kv_heads, group, self.head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(B, self.n_kv_heads, group * T, self.head_dim)
        mask = mask.expand(B, group, T, mask.shape[-1]).reshape(B, 1, group * T, mask.shape[-1])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, n_kv, group * T, D]
        out = out.view(B, self.n_kv_heads, group, T, self.head_dim).permute(0, 3, 1, 2, 4)
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dims: Qwen2Dims):
        super().__init__()
        i = dims.intermediate_size
        self.gate_up_proj = PackedLinear(dims.hidden_size, {"gate_proj": i, "up_proj": i}, bias=False)
        self.down_proj = nn.Linear(i, dims.hidden_size, bias=False)
        keep_checkpoint_names(self, "gate_up_proj")

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, dims: Qwen2Dims):
        super().__init__()
        self.self_attn = Attention(dims)
        self.mlp = MLP(dims)
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, **cache_args) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, **cache_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    def __init__(self, dims: Qwen2Dims):
        super().__init__()
        self.dims = dims
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(dims) for _ in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)

    def forward(self, x: Tensor, positions: Tensor | None = None, cache: KVCache | None = None,
                slots: Tensor | None = None, kv_len: int | None = None) -> Tensor:
        """Input embeddings x [B, T, H] -> hidden states after the final norm [B, T, H].

        positions [B, T] long (default 0..T-1; -1 = padding). Without `cache`: one causal pass over
        x. With `cache` and `slots` [B]: incremental; attention reads the first `kv_len` cache
        positions of each slot (default all; must exceed every position in the batch).
        """
        B, T, _ = x.shape
        if positions is None:
            positions = torch.arange(T, device=x.device).expand(B, T)
        pos = positions.clamp(min=0)
        cos, sin = rope_cos_sin(pos, self.dims.head_dim, self.dims.rope_theta, x.dtype)
        if cache is None:
            # key j is visible from query i if it is not padding and not in the future; a query
            # always sees itself so padding rows stay finite
            mask = (positions[:, None, :] <= pos[:, :, None]) & (positions[:, None, :] >= 0)
            mask = mask | torch.eye(T, dtype=torch.bool, device=x.device)
            cache_args = [{} for _ in self.layers]
        else:
            kv_len = cache.max_len if kv_len is None else kv_len
            mask = torch.arange(kv_len, device=x.device) <= pos[:, :, None]  # [B, T, kv_len]
            write_slot = torch.where(positions >= 0, slots[:, None], cache.scratch_slot)
            cache_args = [dict(cache=(cache.k[i], cache.v[i]), write=(write_slot, pos), read=(slots, kv_len))
                          for i in range(len(self.layers))]
        mask = mask[:, None]
        for layer, args in zip(self.layers, cache_args):
            x = layer(x, cos, sin, mask, **args)
        return self.norm(x)
