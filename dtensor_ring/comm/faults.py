"""Communication that fails with an error naming where it stopped.

Note [Faults]
~~~~~~~~~~~~~
Every rank of a ring waits on its peers at every step. When one rank dies, or stops calling
(it raised, or took another code path), the backend raises on the others: gloo when the
process group's timeout (``timeout=`` of ``init_process_group`` / ``new_group``) runs out in a
wait, or at once when a peer's connection has closed (in a wait, or in ``batch_isend_irecv``).
NCCL's ``wait`` raises ``DistBackendError`` only under ``TORCH_NCCL_BLOCKING_WAIT=1``; by
default its watchdog tears the process down after the timeout. The backend's message names a
socket or a buffer, not the attention call, so every wait of the engine (and the launch of its
point-to-point exchanges) runs inside a :class:`CommSite`, which re-raises a backend
``RuntimeError`` as one naming the operation, the step, this rank and its peers. A site is one
small object per step and its message is built only on failure: no host sync, no transfer.
"""

from __future__ import annotations

from types import TracebackType

import torch.distributed as dist


class CommSite:
    """One launch or wait of the engine's communication; ``with site:`` names its failures.

    Args:
        op: what runs, e.g. ``"ring attention forward, ring exchange of K/V"``.
        group: the process group.
        step: ``(k, n)``: step ``k`` (from 1) of ``n``; None for a single collective.
        peers: ``(send_to, recv_from)`` global ranks of a point-to-point exchange; None for a
            collective over the whole group.
    """

    __slots__ = ("op", "group", "step", "peers")

    def __init__(
        self,
        op: str,
        group: dist.ProcessGroup,
        step: tuple[int, int] | None = None,
        peers: tuple[int | None, int | None] | None = None,
    ):
        self.op, self.group, self.step, self.peers = op, group, step, peers

    def __enter__(self) -> CommSite:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(err, RuntimeError):  # includes DistError / DistBackendError
            raise RuntimeError(self.message(err)) from err

    def message(self, err: BaseException) -> str:
        """The error for a failure ``err`` of the backend at this site."""
        where = "" if self.step is None else f" (step {self.step[0]} of {self.step[1]})"
        cause = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return (
            f"{self.op}{where} failed on rank {dist.get_rank()} ({self._peers()}): {cause}\n"
            "Another rank of the group has probably died or stopped calling (it raised an "
            "exception, or took a different code path and never made this call): look for the "
            "first error in the other ranks' logs. The wait is bounded by the process group's "
            "timeout (timeout= of init_process_group / new_group)."
        )

    def _peers(self) -> str:
        if self.peers is None:
            return "with ranks " + ", ".join(map(str, dist.get_process_group_ranks(self.group)))
        send_to, recv_from = self.peers
        if send_to == recv_from:
            return f"exchanging with rank {send_to}"
        if recv_from is None:
            return f"sending to rank {send_to}"
        if send_to is None:
            return f"receiving from rank {recv_from}"
        return f"sending to rank {send_to}, receiving from rank {recv_from}"
