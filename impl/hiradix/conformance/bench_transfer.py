"""Host <-> device transfer benchmark: our transfer engine against a plain copy (issue 13).

For each direction and copy size, the time of one copy through ``make_engine("auto")``
(on CUDA: ``CudaCopyEngine``, its streams, staging and events; elsewhere the synchronous
engine), from ``submit`` to the acknowledgement that lands it, against one plain
``copy_`` of the same number of bytes between a contiguous device tensor and a
contiguous (pinned, on CUDA) host tensor, in the same run. Pages are copied in order
(``contiguous``) or in a random page order (``scattered``, what a tree's backups look
like). Each copy's bytes are compared once with the source, outside the timings.

    python -m hiradix.conformance.bench_transfer [--device cuda] [--layer-mib 1,4,16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from hiradix.device_pool import DeviceKVPool
from hiradix.host_pool import HostKVPool
from hiradix.transfer import Direction, TransferEngine, make_engine

PAGE = 16
LAYERS = 8
HEADS = 8
HEAD_DIM = 128  # fp16 MHA: 4 KiB a token a layer, 32 KiB a token


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    run()  # warm-up: allocator, streams, staging buffers
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _through_engine(engine: TransferEngine, direction: Direction, device_slots: torch.Tensor,
                    host_slots: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        engine.submit(direction, device_slots, host_slots)
        # The acknowledgement waits for the copy's last event and, for d2h, lands the
        # staged bytes in the host pool: the copy is complete only then.
        while engine.pending(direction):
            _sync(engine.device_pool.device)
            engine.acknowledge(direction, engine.finished(direction))
    return run


def _plain(direction: Direction, nbytes: int, device: torch.device) -> Callable[[], None]:
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    on_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    src, dst = (on_device, on_host) if direction == "d2h" else (on_host, on_device)

    def run() -> None:
        dst.copy_(src, non_blocking=device.type == "cuda")
    return run


def _slots(pages: torch.Tensor) -> torch.Tensor:
    return (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


def rows(device: torch.device, layer_mib: Sequence[float], repeats: int,
         seed: int = 0) -> Iterator[list[str]]:
    per_layer = 2 * HEADS * HEAD_DIM * 2  # bytes a token a layer
    largest = max(int(mib * 2**20) // per_layer for mib in layer_mib)
    pages_needed = -(-largest // PAGE)
    pool = DeviceKVPool(num_slots=2 * pages_needed * PAGE, page_size=PAGE, layers=LAYERS,
                        layout="mha", heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float16,
                        device=device)
    host = HostKVPool.for_device(pool, ratio=1.0)
    engine = make_engine("auto", pool, host)
    generator = torch.Generator().manual_seed(seed)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=generator).to(pool.kv.dtype))
    for mib in layer_mib:
        pages = max(1, int(mib * 2**20) // per_layer // PAGE)
        nbytes = pages * PAGE * pool.bytes_per_token
        for order in ("contiguous", "scattered"):
            if order == "contiguous":
                dev_pages = torch.arange(pages)
                host_pages = torch.arange(pages)
            else:
                dev_pages = torch.randperm(2 * pages_needed, generator=generator)[:pages]
                host_pages = torch.randperm(2 * pages_needed, generator=generator)[:pages]
            dev_slots, host_slots = _slots(dev_pages), _slots(host_pages)
            for direction in ("d2h", "h2d"):
                ours = _median_seconds(_through_engine(engine, direction, dev_slots,
                                                       host_slots), device, repeats)
                plain = _median_seconds(_plain(direction, nbytes, device), device, repeats)
                if direction == "d2h":
                    assert torch.equal(host.read(host_slots), pool.read(dev_slots).cpu()), \
                        "d2h: the host pool does not hold the device's bytes"
                else:
                    assert torch.equal(pool.read(dev_slots).cpu(), host.read(host_slots)), \
                        "h2d: the device pool does not hold the host's bytes"
                yield [direction, f"{mib:g}", f"{nbytes / 2**20:g}", order,
                       f"{nbytes / ours / 1e9:.2f}", f"{nbytes / plain / 1e9:.2f}",
                       f"{plain / ours:.2f}"]


HEADER = ["direction", "MiB/layer", "MiB/copy", "page order", "ours GB/s", "plain copy_ GB/s",
          "ours/plain"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hiradix.conformance.bench_transfer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layer-mib", default="1,4,16",
                        help="copy sizes, in MiB per layer (8 layers, fp16 MHA)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_transfer: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    sizes = [float(x) for x in args.layer_mib.split(",")]
    table = [HEADER, *rows(device, sizes, args.repeats)]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
    for row in table:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"({name}, torch {torch.__version__}; median of {args.repeats} copies after a "
          "warm-up; ours: submit to acknowledgement through make_engine('auto'); plain: "
          "one copy_ of as many contiguous bytes, pinned host memory on CUDA)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
