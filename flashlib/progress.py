"""Progress on long sweeps (the tuner, the benchmark, the data scripts): which item is running, on stderr."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

__all__ = ["progress"]

_T = TypeVar("_T")


def progress(items: Iterable[_T], total: int | None = None, describe: Callable[[_T], str] = str,
             file=None) -> Iterator[_T]:
    """Yield ``items``, saying on stderr which one is running: ``[3/8 00:42] pallas T=2048``.

    tqdm's bar when tqdm is installed (not a dependency), else one plain line per item.
    """
    file = sys.stderr if file is None else file
    items = list(items) if total is None else items
    total = len(items) if total is None else total
    try:
        from tqdm import tqdm
    except ImportError:
        start = time.monotonic()
        for i, item in enumerate(items, 1):
            elapsed = int(time.monotonic() - start)
            print(f"[{i}/{total} {elapsed // 60:02d}:{elapsed % 60:02d}] {describe(item)}", file=file, flush=True)
            yield item
        return
    bar = tqdm(items, total=total, file=file, leave=False)
    for item in bar:
        bar.set_description(describe(item))
        yield item
