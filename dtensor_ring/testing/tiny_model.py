"""A tiny Llama-style causal transformer for composability tests and examples.

Read top to bottom: RMSNorm, RoPE, attention (``F.scaled_dot_product_attention``), SwiGLU MLP,
block, model. Two things make it CP-ready:

* attention goes through ``F.scaled_dot_product_attention``; with a context-parallel mesh set
  (:meth:`TinyTransformer.set_cp_mesh`) the local q/k/v shards are wrapped as ``Shard(2)``
  DTensors on it first (``DTensor.from_local``, no communication), so that inside
  ``dtensor_ring.ring_sdpa`` SDPA runs ring attention, and the output is unwrapped again
  (``to_local``). Everything else works on plain local tensors, as FSDP2 expects;
* RoPE takes **global** position ids ``positions [S_local]`` (``dtensor_ring.token_indices``
  for this rank's layout), never ``arange(S_local)``.

For attention SDPA cannot express (e.g. packed documents through
``dtensor_ring.llama3_flash_attn_varlen_func``), :meth:`TinyTransformer.set_attention_fn`
replaces it: ``fn(q [B, S, H, D], k, v [B, S, K, D], **attn_kwargs) -> [B, S, H, D]`` on local
tensors, where ``attn_kwargs`` are the keyword arguments given to the model's ``forward``.

Shape legend: B batch, S (local) sequence, E model dim, H query heads, K key/value heads,
D head dim, V vocabulary, F MLP hidden dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint


@dataclass
class TinyConfig:
    """Model sizes and options.

    Attributes:
        vocab_size: V.  dim: E.  n_layers: number of blocks.
        n_heads: H.  n_kv_heads: K (``H % K == 0``; ``K < H`` is grouped-query attention).
        ffn_dim: F.  rope_theta: RoPE base.  norm_eps: RMSNorm epsilon.
        activation_checkpointing: recompute each block in backward (``torch.utils.checkpoint``,
            non-reentrant).
    """

    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError("the head dim dim // n_heads must be even for RoPE")


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """RoPE tables for ``positions [S]`` (int, global token indices) -> ``cos, sin [S, D/2]``."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x_BSHD: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> Tensor:
    """Rotate pairs ``(x[..., :D/2], x[..., D/2:])`` of ``x [B, S, H, D]`` by the angles."""
    x1, x2 = x_BSHD.float().chunk(2, dim=-1)
    cos, sin = cos_SD[None, :, None, :], sin_SD[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x_BSHD)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(
            x
        ) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.cp_mesh: DeviceMesh | None = None  # set by TinyTransformer.set_cp_mesh
        self.attention_fn: Callable[..., Tensor] | None = None  # TinyTransformer.set_attention_fn

    def forward(
        self, x_BSE: Tensor, cos_SD: Tensor, sin_SD: Tensor, attn_kwargs: dict[str, Any]
    ) -> Tensor:
        B, S, _ = x_BSE.shape
        q_BSHD = apply_rope(self.wq(x_BSE).view(B, S, self.n_heads, self.head_dim), cos_SD, sin_SD)
        k_BSKD = apply_rope(
            self.wk(x_BSE).view(B, S, self.n_kv_heads, self.head_dim), cos_SD, sin_SD
        )
        v_BSKD = self.wv(x_BSE).view(B, S, self.n_kv_heads, self.head_dim)
        if self.attention_fn is not None:  # a custom attention on the local tensors
            o_BSHD = self.attention_fn(q_BSHD, k_BSKD, v_BSKD, **attn_kwargs)
            return self.wo(o_BSHD.reshape(B, S, -1))
        q_BHSD, k_BKSD, v_BKSD = (t.transpose(1, 2) for t in (q_BSHD, k_BSKD, v_BSKD))
        if self.cp_mesh is not None:  # local shards -> sequence-sharded DTensors
            q_BHSD, k_BKSD, v_BKSD = (
                DTensor.from_local(t, self.cp_mesh, [Shard(2)], run_check=False)
                for t in (q_BHSD, k_BKSD, v_BKSD)
            )
        o_BHSD = F.scaled_dot_product_attention(
            q_BHSD, k_BKSD, v_BKSD, is_causal=True, enable_gqa=self.n_heads != self.n_kv_heads
        )
        if self.cp_mesh is not None:
            o_BHSD = o_BHSD.to_local()
        return self.wo(o_BHSD.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x_BSE: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x_BSE)) * self.w3(x_BSE))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.activation_checkpointing = cfg.activation_checkpointing

    def _forward(
        self, x_BSE: Tensor, cos_SD: Tensor, sin_SD: Tensor, attn_kwargs: dict[str, Any]
    ) -> Tensor:
        h_BSE = x_BSE + self.attn(self.attn_norm(x_BSE), cos_SD, sin_SD, attn_kwargs)
        return h_BSE + self.mlp(self.mlp_norm(h_BSE))

    def forward(
        self, x_BSE: Tensor, cos_SD: Tensor, sin_SD: Tensor, attn_kwargs: dict[str, Any]
    ) -> Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(
                self._forward, x_BSE, cos_SD, sin_SD, attn_kwargs, use_reentrant=False
            )
        return self._forward(x_BSE, cos_SD, sin_SD, attn_kwargs)


class TinyTransformer(nn.Module):
    """Embedding, ``n_layers`` blocks (in ``self.layers``, a ModuleList), norm, output head."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def set_cp_mesh(self, cp_mesh: DeviceMesh | None) -> TinyTransformer:
        """Run attention on sequence-sharded DTensors over the 1-D ``cp_mesh`` (None: off).

        The model's inputs are then this rank's shard of the sequence: ``ids [B, S_local]``
        and its global ``positions [S_local]``; call it inside ``dtensor_ring.ring_sdpa``.
        """
        if cp_mesh is not None and cp_mesh.ndim != 1:
            raise ValueError(f"cp_mesh must be 1-D (e.g. mesh['cp']), got {cp_mesh.ndim}-D")
        for layer in self.layers:
            layer.attn.cp_mesh = cp_mesh
        return self

    def set_attention_fn(self, fn: Callable[..., Tensor] | None) -> TinyTransformer:
        """Attend with ``fn(q, k, v, **attn_kwargs)`` instead of SDPA (None: SDPA again).

        ``q [B, S, H, D]``, ``k, v [B, S, K, D]`` (after RoPE, local tensors) -> ``[B, S, H, D]``;
        ``attn_kwargs`` are the keyword arguments of :meth:`forward`. Takes precedence over
        :meth:`set_cp_mesh`.
        """
        for layer in self.layers:
            layer.attn.attention_fn = fn
        return self

    def forward(self, ids_BS: Tensor, positions_S: Tensor, **attn_kwargs: Any) -> Tensor:
        """Logits ``[B, S, V]`` of token ids ``[B, S]`` at global positions ``[S]``.

        ``attn_kwargs`` go to the attention function of :meth:`set_attention_fn` (if any).
        """
        cos_SD, sin_SD = rope_cos_sin(
            positions_S, self.cfg.dim // self.cfg.n_heads, self.cfg.rope_theta
        )
        h_BSE = self.embed(ids_BS)
        for layer in self.layers:
            h_BSE = layer(h_BSE, cos_SD, sin_SD, attn_kwargs)
        return self.head(self.norm(h_BSE))
