"""A rank's connections to the rest of its pipeline, over ``torch.distributed``.

Hidden states go to the next rank and tokens from the last rank to the first with
point-to-point sends (NCCL between GPUs, gloo on CPUs); prompts, barriers and the report
go over a gloo group. Every wait has a time limit (``--pipeline-timeout``): a rank that
died, raised or hung makes the others fail with an error that names it, never hang. Sends
do not wait for their receiver (the last rank's tokens are read by the first only one
step later); finished ones are dropped after every send, and a block ends when all are.
The bytes sent to and received from each rank are counted by kind.
"""
from __future__ import annotations

import datetime
import re
import time
from collections import defaultdict, deque

import torch
import torch.distributed as dist

from ..switches import MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
from ..config import ConfigError

DEFAULT_TIMEOUT_S = 300.0
FAILED_KEY = "flexgen_infinigen/failed/"  # + rank: the rank it blames for stopping
STORE_TIMEOUT_S = 2.0
BLAME_GRACE_S = 3.0  # how long a failing rank waits for the rank it lost to say why


class PipelineError(RuntimeError):
    """Another rank failed or stopped answering (``blamed``: the rank this one lost)."""

    def __init__(self, message: str, blamed: int | None = None):
        super().__init__(message)
        self.blamed = blamed


def launched_world() -> int | None:
    """The process count torchrun (or a compatible launcher) announced, or None."""
    return WORLD_SIZE.get()


class Link:
    def __init__(self, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S):
        """Join the process group the launcher described in the environment (``RANK``,
        ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)."""
        if timeout_s <= 0:
            raise ConfigError(f"--pipeline-timeout must be positive (got {timeout_s})")
        missing = [s.name for s in (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
                   if not s.is_set()]
        if missing:
            raise ConfigError(f"a pipeline is started by torchrun (missing {', '.join(missing)} "
                              "in the environment): `torchrun --nproc-per-node N -m "
                              "flexgen_infinigen.run --pipeline-stages N ...`")
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world = RANK.get(), WORLD_SIZE.get()
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.comm_device = device if backend == "nccl" else torch.device("cpu")
        try:
            dist.init_process_group(backend, timeout=self.timeout)
            self.control = dist.new_group(backend="gloo", timeout=self.timeout) \
                if backend == "nccl" else None
        except (RuntimeError, ValueError) as e:
            raise PipelineError(f"rank {self.rank}: could not join the pipeline's process "
                                f"group within {timeout_s:.0f} s: {_short(e)}") from None
        self.sent: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.received: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.pending: deque = deque()  # (work, tensor, peer, kind) of unfinished sends
        self.open = True

    # ---- who is where -----------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1

    @property
    def previous(self) -> int:
        return self.rank - 1

    @property
    def next(self) -> int:
        return self.rank + 1

    # ---- point to point ---------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, to: int, kind: str, host: bool = False) -> None:
        """Start sending ``tensor``; ``host``: over the gloo group, from host memory."""
        device = torch.device("cpu") if host else self.comm_device
        tensor = tensor.detach().to(device).contiguous()
        try:
            work = dist.isend(tensor, to, group=self.control if host else None)
        except RuntimeError as e:
            raise self._lost(to, f"sending {kind} to", e, 0.0) from None
        self.pending.append((work, tensor, to, kind))
        self.sent[to][kind] += tensor.numel() * tensor.element_size()
        while self.pending and self.pending[0][0].is_completed():
            self._finish_send()  # drop finished sends (and their tensors) as we go

    def recv(self, shape, dtype: torch.dtype, frm: int, kind: str,
             host: bool = False) -> torch.Tensor:
        """Receive what ``frm`` sent with the same ``host``; on the compute device, or in
        host memory with ``host``."""
        out = torch.empty(shape, dtype=dtype,
                          device=torch.device("cpu") if host else self.comm_device)
        start = time.perf_counter()
        try:
            dist.irecv(out, frm, group=self.control if host else None).wait(self.timeout)
        except RuntimeError as e:
            raise self._lost(frm, f"waiting for {kind} from", e, start) from None
        self.received[frm][kind] += out.numel() * out.element_size()
        return out if host else out.to(self.device)

    def flush(self) -> None:
        """Wait until every send has been received (the end of a block)."""
        while self.pending:
            self._finish_send()

    def _finish_send(self) -> None:
        work, _, to, kind = self.pending[0]
        start = time.perf_counter()
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise self._lost(to, f"sending {kind} to", e, start) from None
        self.pending.popleft()

    def _lost(self, peer: int, what: str, error: Exception, start: float) -> PipelineError:
        waited = time.perf_counter() - start if start else 0.0
        self._record(peer)  # at once: a rank waiting on this one may be failing too
        root = self._first_failure(peer)
        cause = f"rank {peer} exited, raised an error or stopped answering" if root == peer \
            else f"rank {peer} stopped because rank {root} failed first"
        return PipelineError(
            f"pipeline rank {self.rank}: {what} rank {peer} failed after {waited:.1f} s "
            f"({_short(error)}); {cause}: see rank {root}'s output (each rank waits at "
            f"most --pipeline-timeout {self.timeout_s:g} s)", peer)

    # ---- failures, told through the launcher's key-value store ------------------------------
    def record_failure(self, error: BaseException) -> None:
        """Leave word that this rank stops because of its own ``error`` (a lost rank was
        recorded when it was found lost), so that the others name the rank that failed
        first. Best effort."""
        if not isinstance(error, PipelineError):
            self._record(self.rank)

    def _record(self, blamed: int) -> None:
        store = self._store()
        if store is not None:
            try:
                store.set(f"{FAILED_KEY}{self.rank}", str(blamed))
            except Exception:  # noqa: BLE001 - the store's host may be gone too
                pass

    def _first_failure(self, peer: int) -> int:
        """Follow the ranks' words of blame from ``peer`` to the rank that failed first.
        ``peer`` gets a moment to leave its word: it may have timed out waiting on another
        rank just as this one waited on it (its connections close as it times out, before it
        writes), so even a closed connection is no proof that it has said all it will."""
        store, rank, seen = self._store(), peer, {peer}
        grace = time.monotonic() + BLAME_GRACE_S
        while store is not None:
            try:
                key = f"{FAILED_KEY}{rank}"
                if not store.check([key]):
                    if rank == peer and time.monotonic() < grace:
                        time.sleep(0.1)
                        continue
                    break
                blamed = int(store.get(key))
            except Exception:  # noqa: BLE001 - no store: name the rank that was lost
                break
            if blamed in seen:
                break
            seen.add(blamed)
            rank = blamed
        return rank

    def _store(self):
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
            return store
        except Exception:  # noqa: BLE001 - a private helper of torch.distributed
            return None

    # ---- the whole group (gloo) -------------------------------------------------------------
    def broadcast(self, obj, what: str):
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        self._collective(what,
                         lambda: dist.broadcast_object_list(box, src=0, group=self.control))
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's ``obj``, in rank order, on rank 0 (None elsewhere)."""
        out = [None] * self.world if self.is_first else None
        self._collective("gathering the ranks' reports",
                         lambda: dist.gather_object(obj, out, dst=0, group=self.control))
        return out

    def any(self, flag: bool, what: str) -> bool:
        """True on every rank when ``flag`` is true on any."""
        flags = [None] * self.world
        self._collective(what, lambda: dist.all_gather_object(flags, bool(flag),
                                                              group=self.control))
        return any(flags)

    def barrier(self, what: str) -> None:
        """Every rank reached this point; the error names the ranks that did not."""
        self._collective(what, lambda: dist.monitored_barrier(
            group=self.control, timeout=self.timeout, wait_all_ranks=True))

    def _collective(self, what: str, fn) -> None:
        start = time.perf_counter()
        try:
            fn()
        except RuntimeError as e:
            raise PipelineError(
                f"pipeline rank {self.rank}: {what} failed after "
                f"{time.perf_counter() - start:.1f} s ({_short(e)}); another rank exited, "
                "raised an error or stopped answering: see the other ranks' output") from None

    def close(self) -> None:
        """Leave the group after a run that ended well on every rank."""
        if self.open:
            self.open = False
            self.flush()
            dist.destroy_process_group()

    def reset_counters(self) -> None:
        self.sent.clear()
        self.received.clear()

    def traffic(self) -> dict:
        """Bytes sent to and received from each rank, by kind."""
        return {"sent": {str(p): dict(k) for p, k in self.sent.items()},
                "received": {str(p): dict(k) for p, k in self.received.items()}}


def _short(error: Exception) -> str:
    """The first sentence of a backend's message, without its source location."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")[:200]
