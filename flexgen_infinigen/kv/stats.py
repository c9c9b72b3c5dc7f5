"""What a selective KV policy read: rows moved, rows used and rows cached, per layer."""
from __future__ import annotations

import threading
from collections import defaultdict

import torch


FOLD_AT = 4096  # deferred device counts added together past this many


class FetchStats:
    """Thread-safe counters, summed over decode steps, GPU batches and KV head columns.

    ``moved``: rows that crossed to the compute device; ``selected``: rows attention used;
    ``cached``: rows a full fetch would have read. ``speculative`` marks the layers whose
    rows are chosen (the others read everything).
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.moved = defaultdict(int)
        self.selected = defaultdict(int)
        self.cached = defaultdict(int)
        self.speculative: set[int] = set()
        self.speculation_s = 0.0
        self.speculation_events: list = []  # (start, end) CUDA events of each speculation
        self.evicted = 0
        self.bytes_moved = 0.0  # K and V bytes fetched for attention
        self.bytes_full = 0.0  # what fetching every cached row would have moved
        # (layer, moved, selected, row_bytes) with device counts: added up when read, so
        # that a decode step issues no op (a kernel launch on a GPU) to count
        self.deferred: list = []

    def add(self, layer: int, moved, selected, cached: int, row_bytes: float,
            speculative: bool = True) -> None:
        """``moved`` and ``selected``: numbers, or device tensors of row counts (summed
        later, when the report reads them: no op, and no sync, in a decode step)."""
        with self.lock:
            self.bytes_full += cached * row_bytes
            self.cached[layer] += cached
            if speculative:
                self.speculative.add(layer)
            if not isinstance(moved, int) or not isinstance(selected, int):
                self.deferred.append((layer, moved, selected, row_bytes))
                if len(self.deferred) >= FOLD_AT:
                    self._fold()
                return
            self.bytes_moved += moved * row_bytes
            self.moved[layer] += moved
            self.selected[layer] += selected

    def _fold(self) -> None:
        """The deferred counts added into the tables (still device tensors: no sync)."""
        deferred, self.deferred = self.deferred, []
        for layer, moved, selected, row_bytes in deferred:
            moved = moved.sum() if isinstance(moved, torch.Tensor) else moved
            selected = selected.sum() if isinstance(selected, torch.Tensor) else selected
            self.bytes_moved += moved * row_bytes
            self.moved[layer] += moved
            self.selected[layer] += selected

    def _settle(self) -> None:
        """Counts kept on the device (no sync while decoding) become numbers."""
        with self.lock:
            self._fold()
        for table in (self.moved, self.selected, self.cached):
            for layer, n in table.items():
                table[layer] = int(n)
        self.bytes_moved, self.bytes_full = float(self.bytes_moved), float(self.bytes_full)
        self.evicted = int(self.evicted)
        for start, end in self.speculation_events:
            end.synchronize()
            self.speculation_s += start.elapsed_time(end) / 1e3
        self.speculation_events.clear()

    def tables(self) -> dict:
        """The raw counts, to be added into another rank's (:meth:`absorb`)."""
        self._settle()
        return {"moved": dict(self.moved), "selected": dict(self.selected),
                "cached": dict(self.cached), "speculative": sorted(self.speculative),
                "speculation_s": self.speculation_s, "evicted": self.evicted,
                "bytes_moved": self.bytes_moved, "bytes_full": self.bytes_full}

    def absorb(self, t: dict) -> None:
        """Add another pipeline rank's counts (its own layers) to these."""
        self._settle()
        for name in ("moved", "selected", "cached"):
            for layer, n in t[name].items():
                getattr(self, name)[layer] += n
        self.speculative.update(t["speculative"])
        self.speculation_s += t["speculation_s"]
        self.evicted += t["evicted"]
        self.bytes_moved += t["bytes_moved"]
        self.bytes_full += t["bytes_full"]

    def report(self) -> dict:
        """The fractions every selective policy reports.

        ``relative_kv_size``: rows attention used over rows cached, all layers counted (the
        ones that read everything at 1.0); ``relative_kv_size_speculative``: the same over the
        selecting layers only, as the InfiniGen paper counts it; ``kv_fetch_fraction``: rows
        moved over rows cached (equal to the used share when only used rows move).
        """
        self._settle()
        layers = sorted(self.cached)
        total = max(sum(self.cached.values()), 1)
        spec = [i for i in layers if i in self.speculative]
        spec_total = max(sum(self.cached[i] for i in spec), 1)
        return {
            "relative_kv_size": sum(self.selected.values()) / total,
            "relative_kv_size_speculative": sum(self.selected[i] for i in spec) / spec_total
            if spec else None,
            "kv_fetch_fraction": sum(self.moved.values()) / total,
            "kv_selected_fraction": sum(self.selected.values()) / total,
            "kv_fetch_fraction_per_layer": [self.moved[i] / max(self.cached[i], 1)
                                            for i in layers],
            "kv_selected_fraction_per_layer": [self.selected[i] / max(self.cached[i], 1)
                                               for i in layers],
            "kv_bytes_fetched": int(self.bytes_moved),
            "kv_bytes_full_fetch": int(self.bytes_full),
        }
