"""Host <-> device transfer benchmark: our transfer engine against a plain copy (issue 13).

For each direction and copy size, the time of one copy through ``make_engine("auto")``
(on CUDA: ``CudaCopyEngine``, its streams and events, and its Triton or staging path;
elsewhere the synchronous engine), from ``submit`` to the acknowledgement that lands it,
against one plain ``copy_`` of the same number of bytes between a contiguous device tensor
and a contiguous (pinned, on CUDA) host tensor, in the same run. Pages (of 1 and 16 slots
on CUDA, 16 elsewhere) are copied in order (``contiguous``) or in a random page order
(``scattered``, what a tree's backups look like). Each copy's bytes are compared once with
the source, outside the timings.

On CUDA a second table times the load-back a forward pass overlaps (issue 33): one h2d
copy from submit until the current stream has waited for every layer's event
(``wait_layer`` 0..L-1), at 64 KiB to 16 MiB per layer, pages in random order on both
sides, page sizes 1, 16 and 64. The line under the tables says which copy path ran
(``--copy-path``: the Triton kernels or pinned staging; ``auto`` picks Triton where it runs).

    python -m hiradix.bench.transfer [--device cuda] [--layer-mib 1,4,16]
        [--copy-path auto|triton|staging]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from hiradix.device_pool import DeviceKVPool
from hiradix.errors import SlotError
from hiradix.host_pool import HostKVPool
from hiradix.kernels import triton_missing
from hiradix.transfer import (
    CopyPath,
    CudaCopyEngine,
    Direction,
    EngineKind,
    TransferEngine,
    make_engine,
)

PAGE = 16
LAYERS = 8
HEADS = 8
HEAD_DIM = 128  # fp16 MHA: 4 KiB a token a layer, 32 KiB a token
LOAD_BACK_KIB = (64, 256, 1024, 4096, 16384)  # per layer
LOAD_BACK_PAGES = (1, 16, 64)


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


def _slots(pages: torch.Tensor, page: int = PAGE) -> torch.Tensor:
    return (pages[:, None] * page + torch.arange(page)).reshape(-1)


def path_of(engine: TransferEngine) -> str:
    """Which copy path ``engine`` runs, in words."""
    if isinstance(engine, CudaCopyEngine):
        if engine.path == "triton":
            return "cuda engine, triton path (kernels read/write the pinned host pool in place)"
        missing = triton_missing()
        return ("cuda engine, staging path (device gather/scatter + pinned staging + CPU "
                f"index_select/scatter){'' if missing is None else '; ' + missing}")
    return f"{type(engine).__name__} (copies at submit on the CPU)"


def _pools(device: torch.device, slots: int, page: int) -> tuple[DeviceKVPool, HostKVPool]:
    pool = DeviceKVPool(num_slots=slots, page_size=page, layers=LAYERS, layout="mha",
                        heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float16, device=device)
    return pool, HostKVPool.for_device(pool, ratio=1.0)


def rows(device: torch.device, layer_mib: Sequence[float], repeats: int,
         seed: int = 0, *, copy_path: CopyPath = "auto", page: int = PAGE,
         ran: list[str] | None = None) -> Iterator[list[str]]:
    """The rows of the first table, for pages of ``page`` slots; ``ran`` (if given) gets
    the engine's ``path_of``."""
    per_layer = 2 * HEADS * HEAD_DIM * 2  # bytes a token a layer
    largest = max(int(mib * 2**20) // per_layer for mib in layer_mib)
    pages_needed = -(-largest // page)
    pool, host = _pools(device, 2 * pages_needed * page, page)
    engine = make_engine("auto", pool, host, copy_path=copy_path)
    if ran is not None:
        ran.append(path_of(engine))
    generator = torch.Generator().manual_seed(seed)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=generator).to(pool.kv.dtype))
    for mib in layer_mib:
        pages = max(1, int(mib * 2**20) // per_layer // page)
        nbytes = pages * page * pool.bytes_per_token
        for order in ("contiguous", "scattered"):
            if order == "contiguous":
                dev_pages = torch.arange(pages)
                host_pages = torch.arange(pages)
            else:
                dev_pages = torch.randperm(2 * pages_needed, generator=generator)[:pages]
                host_pages = torch.randperm(2 * pages_needed, generator=generator)[:pages]
            dev_slots, host_slots = _slots(dev_pages, page), _slots(host_pages, page)
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
                       f"{plain / ours:.2f}", str(page)]


HEADER = ["direction", "MiB/layer", "MiB/copy", "page order", "ours GB/s", "plain copy_ GB/s",
          "ours/plain", "page"]
TABLE_PAGES = {"cuda": (1, PAGE), "cpu": (PAGE,)}  # the page sizes; CPU: the old rows
LOAD_BACK_HEADER = ["load-back (h2d)", "page", "KiB/layer", "MiB/copy", "ours GB/s",
                    "plain copy_ GB/s", "ours/plain"]


def _load_back(engine: TransferEngine, device_slots: torch.Tensor,
               host_slots: torch.Tensor) -> Callable[[], None]:
    """Submit an h2d copy, make the current stream wait for each layer in order (as a
    forward pass does), then acknowledge it."""
    def run() -> None:
        ticket = engine.submit("h2d", device_slots, host_slots)
        for layer in range(engine.device_pool.layers):
            engine.wait_layer(ticket, layer)
        _sync(engine.device_pool.device)
        engine.acknowledge("h2d", engine.finished("h2d"))
        assert engine.pending("h2d") == 0, "the load-back did not finish"
    return run


def load_back_rows(device: torch.device, repeats: int, seed: int = 0, *,
                   copy_path: CopyPath = "auto", layer_kib: Sequence[int] = LOAD_BACK_KIB,
                   page_sizes: Sequence[int] = LOAD_BACK_PAGES,
                   kind: EngineKind = "cuda") -> Iterator[list[str]]:
    """Per-layer h2d of a load-back: random page order on both sides; a size below one
    page per layer is left out (at page 64, 4 KiB tokens make 256 KiB a page). ``kind``
    is ``cuda`` for the table (its test runs the row logic through ``sync`` on CPU)."""
    per_layer = 2 * HEADS * HEAD_DIM * 2  # bytes a token a layer
    generator = torch.Generator().manual_seed(seed)
    for page in page_sizes:
        most = max(1, max(layer_kib) * 1024 // per_layer // page)
        pool, host = _pools(device, 2 * most * page, page)
        engine = make_engine(kind, pool, host, copy_path=copy_path)
        host.kv.copy_(torch.randn(host.kv.shape, generator=generator).to(host.kv.dtype))
        for kib in layer_kib:
            pages = kib * 1024 // per_layer // page
            if pages == 0:
                continue
            dev_slots = _slots(torch.randperm(2 * most, generator=generator)[:pages], page)
            host_slots = _slots(torch.randperm(2 * most, generator=generator)[:pages], page)
            nbytes = pages * page * pool.bytes_per_token
            ours = _median_seconds(_load_back(engine, dev_slots, host_slots), device, repeats)
            plain = _median_seconds(_plain("h2d", nbytes, device), device, repeats)
            assert torch.equal(pool.read(dev_slots).cpu(), host.read(host_slots)), \
                "load-back: the device pool does not hold the host's bytes"
            yield ["h2d by layer", str(page), f"{pages * page * per_layer / 1024:g}",
                   f"{nbytes / 2**20:g}", f"{nbytes / ours / 1e9:.2f}",
                   f"{nbytes / plain / 1e9:.2f}", f"{plain / ours:.2f}"]


def _print_table(table: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for row in table:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hiradix.bench.transfer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layer-mib", default="0.0625,1,4,16",
                        help="copy sizes, in MiB per layer (8 layers, fp16 MHA)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--copy-path", default="auto", choices=["auto", "triton", "staging"],
                        help="the CUDA engine's copy path (auto: triton where it runs)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_transfer: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    sizes = [float(x) for x in args.layer_mib.split(",")]
    ran: list[str] = []
    try:
        table = [HEADER, *(row for page in TABLE_PAGES[device.type]
                           for row in rows(device, sizes, args.repeats, page=page,
                                           copy_path=args.copy_path, ran=ran))]
    except SlotError as error:  # --copy-path the device cannot run
        print(f"bench_transfer: {error}", file=sys.stderr)
        return 2
    _print_table(table)
    if device.type == "cuda":
        print()
        _print_table([LOAD_BACK_HEADER, *load_back_rows(device, args.repeats,
                                                        copy_path=args.copy_path)])
    else:
        print(f"bench_transfer: the per-layer load-back rows need a CUDA device; not run on "
              f"{device}")
    print(f"path: {ran[0]}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"({name}, torch {torch.__version__}; median of {args.repeats} copies after a "
          "warm-up; ours: submit to acknowledgement through make_engine('auto'); plain: "
          "one copy_ of as many contiguous bytes, pinned host memory on CUDA)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
