"""The ring's layout, schedule and cost, with no devices: which chunks each device holds, what each chunk pair
asks of the worker, how much work each device does at each step, and the transfer against the compute.

:mod:`flashlib.ring` runs the ring on a mesh; everything here is plain Python/NumPy (and ``jnp`` on traced
chunk indices, inside the ring), so the schedule can be counted, drawn and checked without a mesh.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from flashlib.hardware import CHIPS, TpuChip

__all__ = ["DIAGONAL", "FULL", "LOAD_BALANCES", "PARTIAL", "SKIP", "RingPlan", "chunks_of_device", "ring_schedule",
           "transfer_vs_compute"]

LOAD_BALANCES = (None, "zigzag")
SKIP, FULL, DIAGONAL, PARTIAL = 0, 1, 2, 3  # what one (query chunk, key chunk) pair asks of the worker


def chunks_of_device(device: Any, n: int, load_balance: str | None) -> tuple[Any, ...]:
    """The global chunk indices device ``device`` of ``n`` holds (ints, or traced ints inside the ring)."""
    return (device,) if load_balance is None else (device, 2 * n - 1 - device)


class RingPlan(NamedTuple):
    """The static layout of one ring call."""

    n: int  # devices on the ring
    chunks_per_device: int  # 1 (contiguous) or 2 (zigzag)
    chunk: int  # tokens per chunk
    length: int  # the real sequence length (the rest of n * chunks_per_device * chunk is padding)
    causal: bool
    load_balance: str | None

    @staticmethod
    def make(length: int, n: int, causal: bool, load_balance: str | None) -> RingPlan:
        per_device = 1 if load_balance is None else 2
        chunk = -(-length // (n * per_device))  # ceil
        return RingPlan(n, per_device, chunk, length, bool(causal), load_balance)

    @property
    def padded_length(self) -> int:
        return self.n * self.chunks_per_device * self.chunk

    @property
    def partial_keys(self) -> int:
        """The real keys in the one partly padded chunk (0 if the length divides evenly)."""
        return self.length % self.chunk if self.padded_length != self.length else 0

    def kind(self, a: Any, b: Any) -> Any:
        """What query chunk ``a`` asks of key chunk ``b`` (SKIP, FULL, DIAGONAL, PARTIAL); works on ints and
        on traced ints."""
        xp = np if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)) else jnp
        real = xp.clip(self.length - b * self.chunk, 0, self.chunk)  # real keys in chunk b
        q_real = xp.clip(self.length - a * self.chunk, 0, self.chunk)
        visible = xp.where(real == self.chunk, FULL, PARTIAL)
        if self.causal:
            visible = xp.where(b == a, DIAGONAL, xp.where(b < a, visible, SKIP))
        return xp.where((real == 0) | (q_real == 0), SKIP, visible)

    def ring_order(self) -> np.ndarray:
        """The global chunk indices in device order: device ``i``'s contiguous block of the reordered
        sequence is its chunks (for zigzag ``[0, 2n-1, 1, 2n-2, ...]``)."""
        return np.array([c for i in range(self.n) for c in chunks_of_device(i, self.n, self.load_balance)])


def ring_schedule(n: int, *, causal: bool = True, load_balance: str | None = "zigzag", length: int | None = None
                  ) -> dict[str, Any]:
    """Count the work of each device at each ring step: visible ``(query, key)`` score elements.

    Returns ``{"work": [steps, devices] array, "total", "critical_path", "imbalance"}``: the ring's time is
    the sum over steps of the busiest device's work (``critical_path``), and ``imbalance`` is that over the
    ideal ``total / n`` (1.0: perfectly balanced). ``length`` defaults to ``64 n`` tokens.
    """
    if load_balance not in LOAD_BALANCES:
        raise ValueError(f"load_balance must be one of {LOAD_BALANCES}, got {load_balance!r}")
    plan = RingPlan.make(64 * n if length is None else length, n, causal, load_balance)
    c, work = plan.chunk, np.zeros((n, n), np.int64)
    for step in range(n):
        for device in range(n):
            source = (device - step) % n
            for a in chunks_of_device(device, n, load_balance):
                for b in chunks_of_device(source, n, load_balance):
                    kind = int(plan.kind(a, b))
                    keys = c if kind != PARTIAL else plan.partial_keys
                    work[step, device] += {SKIP: 0, FULL: c * keys, PARTIAL: c * keys, DIAGONAL: c * (c + 1) // 2}[kind]
    total, critical = int(work.sum()), int(work.max(axis=1).sum())
    return {"work": work, "total": total, "critical_path": critical, "imbalance": critical * n / max(total, 1)}


def transfer_vs_compute(chip: TpuChip | str, *, chunk: int, heads: int, kv_heads: int | None = None,
                        head_dim: int = 128, bytes_per_element: int = 2) -> dict[str, float]:
    """One ring step's transfer against its compute, on ``chip`` at its peaks (a roofline, not a timing).

    Per chunk pair: the forward's two matmuls are ``4 chunk^2 heads head_dim`` FLOPs at the chip's bf16 peak;
    the next k and v chunks, ``2 chunk kv_heads head_dim bytes_per_element`` bytes, cross one ICI link in one
    direction (:attr:`~flashlib.hardware.TpuChip.ici_link_bandwidth`). The transfer hides behind the compute
    when ``ratio = transfer / compute <= 1``, i.e. for chunks of at least ``break_even_chunk`` tokens: the
    compute grows with ``chunk^2``, the transfer with ``chunk``.
    """
    chip = CHIPS[chip] if isinstance(chip, str) else chip
    if chip.ici_link_bandwidth is None:
        raise ValueError(f"no ICI figures recorded for {chip.name}; choose one of "
                         f"{[c.name for c in CHIPS.values() if c.ici_link_bandwidth]}")
    kv_heads = heads if kv_heads is None else kv_heads
    compute = 4 * chunk * chunk * heads * head_dim / chip.peak_bf16_flops  # s
    transfer = 2 * chunk * kv_heads * head_dim * bytes_per_element / chip.ici_link_bandwidth  # s
    break_even = 2 * kv_heads * bytes_per_element * chip.peak_bf16_flops / (4 * heads * chip.ici_link_bandwidth)
    return {"compute_seconds": compute, "transfer_seconds": transfer, "ratio": transfer / compute,
            "break_even_chunk": break_even}
