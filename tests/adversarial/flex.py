"""Cases of the ``flex`` kind: ``dtensor_ring.flex_attention`` (issue #27) and the module
form ``ContextParallel(attention_type="flex")``.

* ``exact``: masks (causal, documents crossing shard boundaries, document + window, prefix-LM)
  on every layout (ring, zigzag, stripe, the mask-aware one) at W = 1-4, fp64 and fp32,
  forward and backward against the strict fp64 reference (:mod:`tests.adversarial.oracle`);
  the documents also as ``dr.document_mask`` builds them from their boundaries, and on
  ``Shard(2)`` DTensors of the shards. Document masks run on the varlen kernels (Note
  [Document masks on the varlen kernels]); ``kernel:flex_math`` keeps them on the flex
  kernels, ``rows`` gives each batch row documents of its own, ``refilled`` a second batch
  whose document ids were written into the first one's buffer; ``algorithm:all_gather`` runs
  the document masks by the all-gather of placed documents (also on DTensors and the module);
* ``nonfinite``: a NaN / +Inf in one token's q, k or v under a document mask: it must reach
  exactly the rows that see it (the strict reference's pattern);
* ``score_mod``: softcap and a bias of (b, h, q, kv), against ``tests.reference.reference_flex``;
* ``args``: what must raise a clean error on every rank (a mask of the local length, a mask's
  batch, ``kernel_options``, GQA without ``enable_gqa``, DTensors with ``group=``, 3-D and int
  tensors, a
  score_mod closing over a tensor that requires grad, an odd length for zigzag);
* ``disagree``: one rank with another mask, score_mod, BLOCK_SIZE, layout or length, with and
  without the consistency mode: a clean error on every rank;
* ``double_backward``: a ``RuntimeError`` naming double backward on every rank.
"""

from __future__ import annotations

import functools

import torch

from tests.reference import reference_flex

from . import oracle
from .cases import CORRECT, DEBUG_ENV, ERROR, WORLDS, raises_here
from .doors import Ctx
from .oracle import Check, Flag
from .runner import Case

B, H, H_KV, D = 2, 4, 2, 8
S_LOCAL = 12
TILE = 4
MASKS = ("causal", "document", "document_window", "prefix_lm")
LAYOUTS = ("ring", "zigzag", "stripe", "balanced")


def _doc(seq_len: int) -> torch.Tensor:
    """Documents of 7, 3, 10, ... tokens by position: they cross every shard boundary."""
    sizes = [(7, 3, 10)[i % 3] for i in range(seq_len)]
    return torch.repeat_interleave(torch.arange(seq_len), torch.tensor(sizes))[:seq_len]


def mask_mod(name: str, seq_len: int):
    doc = _doc(seq_len)
    return {
        "none": None,
        "causal": lambda b, h, q, kv: q >= kv,
        "document": lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv),
        "document_window": lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv) & (q - kv < 5),
        "prefix_lm": lambda b, h, q, kv: (kv < 5) | (q >= kv),
    }[name]


def _visible(name: str, seq_len: int) -> torch.Tensor:
    i = torch.arange(seq_len)
    if name == "none":
        return torch.ones(seq_len, seq_len, dtype=torch.bool)
    return mask_mod(name, seq_len)(0, 0, i[:, None], i[None, :])


#: masks built by ``dr.document_mask`` from the documents' boundaries -> the mask they equal
FROM_BOUNDARIES = {
    "document@boundaries": "document",
    "document_window@boundaries": "document_window",
}


def _block_mask(name: str, seq_len: int):
    """The BlockMask of mask ``name``: ``create_block_mask`` of its mask_mod, or for the
    ``@boundaries`` names ``dr.document_mask`` of ``_doc``'s boundaries in ``B`` rows."""
    from torch.nn.attention.flex_attention import create_block_mask

    import dtensor_ring as dr

    if name == "none":
        return None
    if name not in FROM_BOUNDARIES:
        return create_block_mask(mask_mod(name, seq_len), None, None, seq_len, seq_len, "cpu", TILE)
    doc = _doc(seq_len)
    starts = [0, *((doc[1:] != doc[:-1]).nonzero()[:, 0] + 1).tolist()]
    cu = torch.tensor([b * seq_len + i for b in range(B) for i in starts] + [B * seq_len])
    window = (4, 0) if name.startswith("document_window") else (-1, 0)
    return dr.document_mask(cu, seq_len, window, block_size=TILE)


def softcap(s, b, h, q, kv):
    return 4.0 * torch.tanh(s / 4.0)


def bias(s, b, h, q, kv):
    return s - 0.3 * (h + 1) * (q - kv).abs() / 8 + 0.2 * b


def _capped(cap, s, b, h, q, kv):
    return cap * torch.tanh(s / cap)


def _table_bias(table, s, b, h, q, kv):
    return s + table[kv]


def _grad_bias(table, s, b, h, q, kv):
    return s + table[kv]


def _data(seq_len: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, seq_len, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, H_KV, seq_len, D, generator=gen, dtype=torch.float64) for _ in "kv")
    dout = torch.randn(B, H, seq_len, D, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def _layout(name: str, block_mask, world: int):
    import dtensor_ring as dr

    return dr.flex_layout(block_mask, world, chunks_per_rank=2) if name == "balanced" else name


def flex_case(
    ctx: Ctx,
    mask: str,
    layout: str,
    dtype: str = "float64",
    poison: tuple[str, int, float] | None = None,
    score: str | None = None,
    module: bool = False,
    dtensor: bool = False,
    backend: str | None = None,
    fake_read_first: bool = False,
    algorithm: str | None = None,
) -> dict:
    """One call (or the module form) on this rank's shard, against the fp64 reference
    (``fake_read_first``: rank 0 alone first asks for the mask's reading inside a
    ``FakeTensorMode``, where it cannot trace the mask_mod: a fact of that rank only)."""
    import dtensor_ring as dr

    W, rank, S = ctx.world, ctx.rank, S_LOCAL * ctx.world
    q, k, v, dout = _data(S)
    if poison is not None:  # one token's q, k or v: NaN / Inf
        which, token, value = poison
        {"q": q, "k": k, "v": v}[which][:, :, token] = value
    bm = _block_mask(mask, S)
    if fake_read_first and rank == 0:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            dr.mask_documents(bm, B)
    mask = FROM_BOUNDARIES.get(mask, mask)
    mod = mask_mod(mask, S)
    extra = {} if backend is None else {"backend": backend}
    if algorithm is not None:
        extra["algorithm"] = algorithm
    lay = _layout(layout, bm, W)
    idx = dr.token_indices(lay, S, rank, W)
    torch_dtype = getattr(torch, dtype)
    leaves = [x[:, :, idx].to(torch_dtype).requires_grad_() for x in (q, k, v)]
    score_mod = {None: None, "softcap": softcap, "bias": bias}[score]
    if dtensor:  # Shard(2) DTensors of the shards, group=None: a DTensor back
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = DeviceMesh.from_group(ctx.group, "cpu")
        placed = [DTensor.from_local(x, mesh, [Shard(2)]) for x in leaves]  # grads: to leaves
        out = dr.flex_attention(
            *placed, score_mod=score_mod, block_mask=bm, enable_gqa=True, layout=lay, **extra
        )
        assert isinstance(out, DTensor) and tuple(out.placements) == (Shard(2),), out
        out = out.to_local()
    elif module:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = DeviceMesh.from_group(ctx.group, "cpu")
        style = dr.ContextParallel(attention_type="flex", layout=lay, algorithm=algorithm)
        attention = parallelize_module(_FlexModule(), mesh, style)
        out = attention(*leaves, score_mod=score_mod, block_mask=bm, enable_gqa=True)
    else:
        out = dr.flex_attention(
            *leaves, score_mod=score_mod, block_mask=bm, enable_gqa=True, group=ctx.group,
            layout=lay, **extra,
        )  # fmt: skip
    (out * dout[:, :, idx].to(torch_dtype)).sum().backward()
    tol = oracle.tolerance(torch_dtype)
    if score_mod is None:
        ref = oracle.strict_attention(
            *(x.transpose(1, 2) for x in (q, k, v)), _visible(mask, S), D**-0.5,
            dout.transpose(1, 2),
        )  # fmt: skip
        want = [ref.out, ref.dq, ref.dk, ref.dv]
        want = [w.transpose(1, 2) for w in want]
    else:
        ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        ref_out, _ = reference_flex(*ref_leaves, mask_mod=mod, score_mod=score_mod)
        ref_out.backward(dout)
        want = [ref_out.detach(), *(x.grad for x in ref_leaves)]
    got = [out.detach(), *(x.grad for x in leaves)]
    return {
        name: Check(g, w[:, :, idx], torch_dtype, *tol)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
    }


def rows_case(ctx: Ctx, layout: str, window: int, refill: bool) -> dict:
    """Each batch row its own documents (the mask reads ``b``), ``window``: a sliding window
    within them (0: none); ``refill``: a first call, then the second batch's document ids
    written into the same buffer and its mask built anew (a training loop's reuse), and the
    second call checked."""
    from torch.nn.attention.flex_attention import create_block_mask

    import dtensor_ring as dr

    W, rank, S = ctx.world, ctx.rank, S_LOCAL * ctx.world
    q, k, v, dout = _data(S, seed=2)

    def ids_of(cuts_per_row):
        ids = torch.zeros(B, S, dtype=torch.int64)
        for b, cuts in enumerate(cuts_per_row):
            for c in cuts:
                ids[b, c:] += 1
        return ids

    first = [[5, S - 3], [1, S // 2, S // 2 + 1]]
    second = [[S // 3], [2, 3, 4, S - 1]]
    ids = ids_of(second if not refill else first)

    def mod(b, h, q_idx, kv_idx):
        seen = (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)
        return seen & (q_idx - kv_idx < window) if window else seen

    def call(leaves):
        bm = create_block_mask(mod, B, None, S, S, "cpu", TILE)
        lay = _layout(layout, bm, W)
        idx = dr.token_indices(lay, S, rank, W)
        local = [x[:, :, idx].clone().requires_grad_() for x in leaves]
        out = dr.flex_attention(*local, block_mask=bm, enable_gqa=True, group=ctx.group, layout=lay)
        return out, local, idx

    if refill:
        call((q, k, v))
        ids.copy_(ids_of(second))
    out, local, idx = call((q, k, v))
    (out * dout[:, :, idx]).sum().backward()
    i = torch.arange(S)
    visible = torch.stack([mod(b, 0, i[:, None], i[None, :]) for b in range(B)])  # [B, S, S]
    want = []
    for b in range(B):  # the strict reference, one batch row at a time
        ref = oracle.strict_attention(
            *(x[b : b + 1].transpose(1, 2) for x in (q, k, v)), visible[b], D**-0.5,
            dout[b : b + 1].transpose(1, 2),
        )  # fmt: skip
        want.append([ref.out, ref.dq, ref.dk, ref.dv])
    want = [torch.cat([w[j] for w in want]).transpose(1, 2) for j in range(4)]
    got = [out.detach(), *(x.grad for x in local)]
    tol = oracle.tolerance(torch.float64)
    return {
        name: Check(g, w[:, :, idx], torch.float64, *tol)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
    }


class _FlexModule(torch.nn.Module):
    """A ``flex_attention`` wrapper module (PyTorch's FLEX style's contract)."""

    def forward(self, *args, **kwargs):
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(*args, **kwargs)


#: name -> (keyword arguments of the call given (S, W), what to change in the inputs)
BAD = {
    "local_length_mask": lambda S, W: {"mask_len": S // W},
    "mask_batch": lambda S, W: {"mask_batch": 3},
    "kernel_options": lambda S, W: {"kernel_options": {"BLOCK_M": 64}},
    "gqa_without_flag": lambda S, W: {"enable_gqa": False},
    "dtensor_inputs_and_group": lambda S, W: {"dtensor": True},  # DTensors take group=None
    "three_dim": lambda S, W: {"squeeze": True},
    "int_tensors": lambda S, W: {"int": True},
    "grad_capturing_score_mod": lambda S, W: {
        "score_mod": functools.partial(_grad_bias, torch.zeros(S, requires_grad=True))
    },
    "zigzag_odd_length": lambda S, W: {"layout": "zigzag", "s_local": 7},
    "score_mod_not_callable": lambda S, W: {"score_mod": 3},
    "block_mask_and_mask_mod": lambda S, W: {"mask_mod": lambda b, h, q, kv: q >= kv},
    # the all-gather of placed documents where the call does not run as documents
    "all_gather_with_lse": lambda S, W: {"algorithm": "all_gather", "return_lse": True},
    "all_gather_with_flex_kernel": lambda S, W: {"algorithm": "all_gather", "backend": "flex_math"},
}


def bad_case(ctx: Ctx, name: str | None) -> dict:
    """A call that must raise ValueError / TypeError on every rank before communicating (None:
    a valid call)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.nn.attention.flex_attention import create_block_mask

    import dtensor_ring as dr

    W = ctx.world
    kw = {} if name is None else BAD[name](S_LOCAL * W, W)
    s_local = kw.pop("s_local", S_LOCAL)
    S = s_local * W
    q, k, v, _ = _data(S)
    mask_len = kw.pop("mask_len", S)
    bm = create_block_mask(
        mask_mod("causal", mask_len), kw.pop("mask_batch", None), None, mask_len, mask_len,
        "cpu", TILE,
    )  # fmt: skip
    idx = torch.arange(ctx.rank * s_local, (ctx.rank + 1) * s_local)
    tensors = [x[:, :, idx] for x in (q, k, v)]
    if kw.pop("dtensor", False):
        mesh = DeviceMesh.from_group(ctx.group, "cpu")
        tensors = [DTensor.from_local(t, mesh, [Shard(2)]) for t in tensors]
    if kw.pop("squeeze", False):
        tensors = [t[0] for t in tensors]
    if kw.pop("int", False):
        tensors = [t.long() for t in tensors]
    kw.setdefault("enable_gqa", True)
    dr.flex_attention(*tensors, block_mask=bm, group=ctx.group, **kw)
    return {"raised": Flag(False, "no error")}


#: name -> what rank 0 changes
DISAGREE = (
    "mask", "score_mod", "block_size", "layout", "length",
    # the same functions and tiles, other data: a document boundary moved within its tile
    # (on the varlen kernels, and with a score_mod on the flex kernels), a score table's value
    "mask_data", "mask_data+score_mod", "score_data",
    "score_constant",  # the same softcap function closing over another float
    # facts that pick the route (Note [Document masks on the varlen kernels]): the lse asked
    # for, the flex kernel named rather than chosen (the one None chooses)
    "return_lse", "backend",
    # an argument only rank 0 gets wrong: its error reaches every rank
    "bad_aux", "bad_algorithm",
    "algorithm",  # the all-gather of placed documents on rank 0, the ring on the others
)  # fmt: skip


def disagree_case(ctx: Ctx, what: str) -> dict:
    """Rank 0 differs from the others in ``what``: a clean error on every rank."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    import dtensor_ring as dr

    first = ctx.rank == 0
    s_local = S_LOCAL + 2 * (first and what == "length")
    S = s_local * ctx.world
    q, k, v, _ = _data(S)
    mask = "document" if first and what == "mask" else "causal"
    tile = 2 * TILE if first and what == "block_size" else TILE
    mod = mask_mod(mask, S)
    if what.startswith("mask_data"):  # documents 0..6, 7.. on the others; 0..5, 6.. on rank 0
        doc = (torch.arange(S) >= (6 if first else 7)).long()

        def mod(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)

    bm = create_block_mask(mod, None, None, S, S, "cpu", tile)
    layout = "zigzag" if first and what == "layout" else "ring"
    score_mod = softcap if first and what == "score_mod" else None
    if what == "mask_data+score_mod":
        score_mod = softcap
    if what == "score_constant":
        cap = 5.0 if first else 4.0
        score_mod = functools.partial(_capped, cap)
    if what == "score_data":  # a per-key bias, one value different on rank 0
        table = torch.zeros(S, dtype=torch.float64)
        table[3] = 1.0 if first else 0.0
        score_mod = functools.partial(_table_bias, table)
    idx = dr.token_indices(layout, S, ctx.rank, ctx.world)
    dr.flex_attention(
        *(x[:, :, idx] for x in (q, k, v)), score_mod=score_mod, block_mask=bm, enable_gqa=True,
        return_lse=first and what == "return_lse", group=ctx.group, layout=layout,
        backend="flex_math" if first and what == "backend" else None,
        return_aux=AuxRequest(max_scores=True) if first and what == "bad_aux" else None,
        algorithm={"bad_algorithm": "ulysses", "algorithm": "all_gather"}.get(what)
        if first else None,
    )  # fmt: skip
    return {"raised": Flag(False, "no error")}


def bad_on_rank0_case(ctx: Ctx, name: str) -> dict:
    """Rank 0 alone makes the call ``BAD[name]``, the others a valid one (:func:`raises_here`)."""
    return raises_here(lambda: bad_case(ctx, name if ctx.rank == 0 else None))


def double_backward_case(ctx: Ctx) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask

    import dtensor_ring as dr

    S = S_LOCAL * ctx.world
    q, k, v, dout = _data(S)
    bm = create_block_mask(mask_mod("document", S), None, None, S, S, "cpu", TILE)
    idx = dr.token_indices("ring", S, ctx.rank, ctx.world)
    leaves = [x[:, :, idx].requires_grad_() for x in (q, k, v)]
    out = dr.flex_attention(*leaves, block_mask=bm, enable_gqa=True, group=ctx.group)
    try:
        torch.autograd.grad((out * dout[:, :, idx]).sum(), leaves, create_graph=True)
    except RuntimeError as e:
        return {"double_backward": Flag("double backward" in str(e), f"raised {e}")}
    return {"double_backward": Flag(False, "create_graph=True did not raise")}


def flex_cases() -> list[Case]:
    """The ``flex`` kind (see the module docstring)."""
    cases = []

    def add(detail: str, world: int, fn, params: dict, expect=CORRECT, env=None) -> None:
        door = "ContextParallel[flex]" if params.get("module") else "flex_attention"
        name = f"flex/{door}/W{world}/{detail}"
        cases.append(Case(name, "flex", world, fn, params, expect, env or {}))

    for world in WORLDS:
        for mask in MASKS:
            for layout in LAYOUTS:
                add(f"{mask},{layout}", world, flex_case, {"mask": mask, "layout": layout})
        for mask, layout in (("document@boundaries", "balanced"),
                             ("document_window@boundaries", "zigzag")):  # fmt: skip
            add(f"{mask},{layout}", world, flex_case, {"mask": mask, "layout": layout})
        add("document,zigzag,float32", world, flex_case,
            {"mask": "document", "layout": "zigzag", "dtype": "float32"})  # fmt: skip
        for which, token, value in (("k", 5, float("nan")), ("v", 9, float("inf")),
                                    ("q", 2, float("nan"))):  # fmt: skip
            poison = (which, min(token, S_LOCAL * world - 1), value)
            add(f"nonfinite:{which}[{poison[1]}]={value},document,ring", world, flex_case,
                {"mask": "document", "layout": "ring", "poison": poison})  # fmt: skip
        for score in ("softcap", "bias"):
            add(f"score_mod:{score},prefix_lm,balanced", world, flex_case,
                {"mask": "prefix_lm", "layout": "balanced", "score": score})  # fmt: skip
        add("no_mask,ring", world, flex_case, {"mask": "none", "layout": "ring"})
        add("rank_local:read_in_fake_mode_on_rank0,document,zigzag", world, flex_case,
            {"mask": "document", "layout": "zigzag", "fake_read_first": True})  # fmt: skip
        for mask in ("causal", "document", "document_window"):  # on the flex kernels
            add(f"{mask},zigzag,kernel:flex_math", world, flex_case,
                {"mask": mask, "layout": "zigzag", "backend": "flex_math"})  # fmt: skip
        add("nonfinite:k[5]=nan,document,ring,kernel:flex_math", world, flex_case,
            {"mask": "document", "layout": "ring", "backend": "flex_math",
             "poison": ("k", 5, float("nan"))})  # fmt: skip
        for layout, window, refill in (("ring", 0, False), ("zigzag", 4, False),
                                       ("balanced", 0, True), ("stripe", 3, True)):  # fmt: skip
            add(f"rows{',refilled' if refill else ''},window={window},{layout}", world,
                rows_case, {"layout": layout, "window": window, "refill": refill})  # fmt: skip
        add("dtensor,document,balanced", world, flex_case,
            {"mask": "document", "layout": "balanced", "dtensor": True})  # fmt: skip
        module = {"mask": "document_window", "layout": "zigzag", "module": True, "score": "softcap"}
        add("module,document_window,zigzag", world, flex_case, module)
        for mask in ("causal", "document", "document_window"):  # documents: the all-gather
            for layout in LAYOUTS:
                add(f"{mask},{layout},algorithm:all_gather", world, flex_case,
                    {"mask": mask, "layout": layout, "algorithm": "all_gather"})  # fmt: skip
        add("nonfinite:k[5]=nan,document,ring,algorithm:all_gather", world, flex_case,
            {"mask": "document", "layout": "ring", "algorithm": "all_gather",
             "poison": ("k", 5, float("nan"))})  # fmt: skip
        add("dtensor,document,balanced,algorithm:all_gather", world, flex_case,
            {"mask": "document", "layout": "balanced", "dtensor": True,
             "algorithm": "all_gather"})  # fmt: skip
        add("module,document_window,zigzag,algorithm:all_gather", world, flex_case,
            {"mask": "document_window", "layout": "zigzag", "module": True,
             "algorithm": "all_gather"})  # fmt: skip
        add("double_backward", world, double_backward_case, {})
    for world in (1, 3):
        for name in BAD:
            if world == 1 and name == "local_length_mask":  # the local length is the global
                continue
            add(f"args:{name}", world, bad_case, {"name": name}, ERROR)
    for i, name in enumerate(BAD):
        add(f"args:rank0:{name}", 2 + i % 2, bad_on_rank0_case, {"name": name})
    for what in DISAGREE:
        for world in (2, 3):
            for tag, env in (("nodebug", {}), ("debug", DEBUG_ENV)):
                add(f"disagree:{what}[{tag}]", world, disagree_case, {"what": what}, ERROR, env)
    return cases
