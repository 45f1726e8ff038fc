"""DTensor front door: ``F.scaled_dot_product_attention`` on sequence-sharded DTensors.

Public names: :func:`ring_sdpa` (the scope), :func:`scaled_dot_product_ring_attention` (the
function SDPA calls become), :func:`shard_sequence` / :func:`unshard_sequence`.

Shape legend: B batch, H query heads, H_kv key/value heads, S sequence, D head dim. SDPA's
layout is ``[B, H, S, D]`` (sequence dim 2); the op's is ``[B, S, H, D]`` (sequence dim 1).
:func:`swap_seq_heads` is the only conversion between them (a transpose view).

Note [DTensor global view of a permuted layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DTensor has no notion of token order: a DTensor sharded ``Shard(seq_dim)`` over the W ranks of
the context-parallel mesh dim means "the global tensor is the concatenation of the rank shards
in rank order". With the ring layout that *is* the sequence. With zigzag or stripe
(Note [Sequence layouts] in ``layouts/base.py``) each rank holds a permuted selection of tokens, so
the DTensor's global view is the **permuted** sequence, e.g. S = 8, W = 2, zigzag:

    original order          0 1 2 3 4 5 6 7
    rank 0 holds            0 1 | 6 7
    rank 1 holds            2 3 | 4 5
    DTensor global view     0 1 6 7 2 3 4 5     (what full_tensor() / redistribute() return)

Consequences:

* Elementwise and per-token ops (linear layers, norms, activations, RoPE with the right
  position ids, token-level losses and their mean) are unaffected: they commute with any
  permutation of tokens. So is ring attention, which is told the layout.
* Ops that mix positions (cumsum, convolutions or shifts along the sequence, slicing a window
  of positions, ``full_tensor()`` compared with an unpermuted tensor) see the permuted order.
  Build position ids with :func:`dtensor_ring.token_indices` (or shard them with
  :func:`shard_sequence` like the inputs) and shift labels *before* sharding.
* Only :func:`unshard_sequence` (or :func:`dtensor_ring.gather_sequence` on plain local
  tensors) restores the original order.

:func:`shard_sequence` builds such DTensors for inputs, labels and position ids alike.

Note [How SDPA on DTensors reaches ring attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``F.scaled_dot_product_attention`` is a composite: it picks a fused kernel from the inputs'
(global) metadata and calls that aten op (``_scaled_dot_product_flash_attention_for_cpu``,
``_scaled_dot_product_flash_attention``, ``_efficient_attention``, ``_cudnn_attention``),
whose autograd formula later calls the matching ``..._backward`` op. On DTensors both reach
DTensor's dispatcher, which offers a table of custom op handlers (private; walled off in
``_compat/dtensor.py``). ``with ring_sdpa(layout=...)`` installs, and removes on exit:

1. Handlers for all four SDPA op families, forward and backward (:data:`ATEN_SDPA_OPS`, one
   row per family; arguments are bound by schema name, so one forward and one backward
   handler serve every row). The forward handler validates placements, transposes the local
   shards to ``[B, S, H, D]`` and calls ``dtensor_ring::ring_attention`` on them; it returns
   ``(out, lse)`` as DTensors (plus whatever else the op's schema returns); the backward
   handler gets them back from autograd and calls ``dtensor_ring::ring_attention_backward``.

2. A ``TorchFunctionMode`` (public API) that sees the SDPA call *before* kernel choice. It
   raises a clear ``ValueError`` for what ring attention does not do (attn_mask, dropout,
   bad placements); where the handlers serve the call (below), it runs SDPA under
   ``sdpa_kernel`` restricted to the enabled fused backends: never the math fallback, which
   would decompose into sharded matmuls that never reach a handler. Being a mode, it is on
   the stack Dynamo guards: a function compiled outside the scope is recompiled inside it,
   and the other way round. (The handler table alone is invisible to Dynamo's guards.)

In plain eager code the mode, having checked the call, runs it itself as one autograd node
on the local shards, past SDPA's kernel choice and DTensor's dispatch (Note [Eager SDPA on
DTensors] in ``eager.py``: the same resolution and engine calls, so the same bits). The
handlers serve every other way a call arrives: compiled code (the handlers act while
AOTAutograd traces, after Dynamo; Dynamo also traces checkpointed regions, higher-order ops,
without the ambient mode), calls under another Python mode (selective activation
checkpointing's), and the fused aten ops called directly. A checkpoint's forward and its
recomputation take the same route (an eager recomputation re-enters the mode: Note
[Recomputation outside the scope] in ``api/recompute.py``), so their saved tensors match. (The
handler table is process-wide, while modes are thread-local: CUDA backward runs on autograd's
device threads; the eager route's backward is its own node's.) It follows that the scope must
be entered outside ``torch.compile``'d code; entering it inside raises ``RuntimeError``.

:func:`scaled_dot_product_ring_attention` is the scope-free alternative: it calls our op on the
DTensors directly (its sharding rule is registered with ``register_sharding``, public), works
in eager and compiled code alike, and needs no private API.

An all-gather layout ("llama3_zigzag") runs ``dtensor_ring::llama3_attention`` (and its
backward) in place of the ring op pair, on the local shards (Note [All-gather layouts on
DTensors] in ``gather.py``).

Outside the scope nothing of this is active: SDPA on DTensors behaves as PyTorch makes it.
The sharding rules of our own ops stay registered (they concern only ``dtensor_ring::`` ops).

Note [Ulysses in the DTensor path]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``ring_sdpa(..., mode="ulysses")`` and ``scaled_dot_product_ring_attention(..., mode=
"ulysses")`` run Ulysses attention (Note [Ulysses attention] in ``ops/ulysses.py``) instead of ring
attention. Everything above stays as it is; only the op pair changes (:data:`MODE_OPS`):
``dtensor_ring::ulysses_attention`` / ``_backward`` have the schemas of ``ring_attention`` /
``_backward`` (sequence shards in and out, lse ``[B, H, S_local]``), so the handlers, the
sharding rules and the autograd formula are shared. The SDPA handlers get the forward and, later,
a separate backward call with only sequence-sharded tensors, so the backward op redoes the
all-to-alls of q, k, v (and brings dout, out and lse to head shards) rather than keeping
head-sharded tensors between the calls: one more all-to-all of q, k, v per backward than
:func:`dtensor_ring.ulysses_flash_attn_func`, and nothing stateful, so activation
checkpointing's recompute and compiled graphs see the same ops. Ulysses takes every layout,
causal or not; ``H`` must be divisible by the context-parallel size (checked on global
metadata, on every rank, before communication).
"""

from . import rules  # noqa: F401  (registers the sharding rules of our ops)
from .function import SDPAConfig, scaled_dot_product_ring_attention
from .handlers import ATEN_SDPA_OPS, aten_sdpa_backward_handler, aten_sdpa_forward_handler
from .scope import ring_sdpa
from .sharding import shard_sequence, unshard_sequence

__all__ = [
    "ATEN_SDPA_OPS",
    "SDPAConfig",
    "aten_sdpa_backward_handler",
    "aten_sdpa_forward_handler",
    "ring_sdpa",
    "scaled_dot_product_ring_attention",
    "shard_sequence",
    "unshard_sequence",
]
