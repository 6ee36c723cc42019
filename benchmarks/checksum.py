"""Checksum throughput for checkpoint arrays, next to orbax's own save and restore speed.

Every array a checkpoint writes gets a CRC-32 of its bytes (``zlib.crc32``, standard
library) that restore verifies. This measures GB/s of that checksum on arrays of a few
sizes, and, for context, of ``crc32c`` and ``hashlib`` digests (when installed) and of a
full ``CheckpointManager`` save and restore of the same bytes. Best of ``--repeats``.

    python benchmarks/checksum.py [--mib 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from functree.train.checkpoint._arrays import checksum


def _best(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _hashes() -> dict[str, Callable[[Any], Any]]:
    out: dict[str, Callable[[Any], Any]] = {
        "zlib.crc32 (used)": zlib.crc32,
        "hashlib.sha256": lambda b: hashlib.sha256(b).digest(),
        "hashlib.blake2b": lambda b: hashlib.blake2b(b).digest(),
    }
    try:
        import crc32c  # optional, for comparison only

        out["crc32c.crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    return out


def _orbax(array: np.ndarray, repeats: int) -> tuple[float, float]:
    import functree as ft

    root = tempfile.mkdtemp()
    try:
        steps = iter(range(10**6))

        def save() -> None:
            with ft.train.CheckpointManager(f"{root}/ckpt", max_to_keep=1) as manager:
                manager.save(next(steps), {"w": array})

        save_s = _best(save, repeats)
        manager = ft.train.CheckpointManager(f"{root}/ckpt", max_to_keep=1)
        restore_s = _best(lambda: np.asarray(manager.restore().model["w"]), repeats)
        return save_s, restore_s
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{platform.processor() or platform.machine()}, numpy {np.__version__}\n")
    print("| what | array | GB/s |")
    print("|---|---|---|")
    for mib in (1, 16, args.mib):
        array = rng.normal(size=mib * 2**18).astype(np.float32)
        data = array.view(np.uint8)
        for name, fn in _hashes().items():
            seconds = _best(lambda fn=fn, data=data: fn(data), args.repeats)
            print(f"| {name} | {mib} MiB | {array.nbytes / seconds / 1e9:.2f} |")
        seconds = _best(lambda array=array: checksum(array), args.repeats)
        print(f"| checksum() incl. conversion | {mib} MiB | {array.nbytes / seconds / 1e9:.2f} |")
    array = rng.normal(size=args.mib * 2**18).astype(np.float32)
    save_s, restore_s = _orbax(array, min(args.repeats, 3))
    print(f"| CheckpointManager.save (incl. checksum) | {args.mib} MiB | {array.nbytes / save_s / 1e9:.2f} |")
    print(f"| CheckpointManager.restore (incl. verify) | {args.mib} MiB | {array.nbytes / restore_s / 1e9:.2f} |")


if __name__ == "__main__":
    main()
