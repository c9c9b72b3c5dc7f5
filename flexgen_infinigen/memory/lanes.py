"""Asynchronous lanes for the overlapped schedule.

Each lane (weight loads, cache loads, cache stores) is one worker thread; on
CUDA it also owns a CUDA stream. Work submitted to a cache lane first waits for
what the compute stream has issued so far (so a store sees the values it
stores); weight loads depend on nothing computed and do not wait. The compute
stream waits for a lane's work only where it uses the result. Tensors handed to
a lane are marked as used on its stream, so the caching allocator cannot give
their memory to later compute kernels before the lane's copies have read them.
With ``enabled=False`` work runs inline, in program order.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

LANES = ("weights", "cache_load", "cache_store")


def _record_on(value, stream) -> None:
    """Tell the CUDA allocator that ``value``'s tensors are used on ``stream`` too."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _record_on(v, stream)
    elif isinstance(value, dict):
        for v in value.values():
            _record_on(v, stream)


class Pending:
    def __init__(self, future: Future | None = None, value=None, event=None):
        self.future, self.value, self.event = future, value, event


class Lanes:
    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.pools = {name: ThreadPoolExecutor(1, thread_name_prefix=name) for name in LANES} \
            if enabled else {}
        self.streams = {name: torch.cuda.Stream(device) for name in LANES} \
            if enabled and self.cuda else {}
        self.outstanding: list[Pending] = []

    def submit(self, lane: str, fn, *args, inline: bool = False, track: bool = True) -> Pending:
        """Run ``fn(*args)`` on ``lane``; ``inline`` work (nothing to move) runs right here.

        ``track``: :meth:`sync` waits for it (cache lanes); untracked work (weight loads) is
        waited for only by :meth:`result`, where it is used."""
        if not self.enabled or inline:
            return Pending(value=fn(*args))
        if not self.cuda:
            pending = Pending(self.pools[lane].submit(fn, *args))
        else:
            ready = None if lane == "weights" else torch.cuda.current_stream().record_event()
            stream = self.streams[lane]
            _record_on(args, stream)

            def run():
                if ready is not None:
                    stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    value = fn(*args)
                    return value, stream.record_event()

            pending = Pending(self.pools[lane].submit(run))
        if track:
            self.outstanding.append(pending)
        return pending

    def result(self, pending: Pending):
        """The lane's result, safe to use on the compute stream."""
        if pending.future is None:
            return pending.value
        out = pending.future.result()
        if not self.cuda:
            return out
        value, event = out
        compute = torch.cuda.current_stream()
        compute.wait_event(event)
        _record_on(value, compute)
        return value

    def sync(self) -> None:
        """Wait for everything submitted so far (one synchronization per schedule step)."""
        for pending in self.outstanding:
            self.result(pending)
        self.outstanding.clear()

    def close(self) -> None:
        """Stop the lanes: queued work is dropped, running work finishes."""
        for pool in self.pools.values():
            pool.shutdown(wait=True, cancel_futures=True)
