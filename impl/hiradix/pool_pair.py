"""The check that a device pool and a host pool may be copied between (one geometry), shared
by every copier of the pair: the transfer engines and the Triton kernels (issue 33)."""

from __future__ import annotations

from hiradix.device_pool import DeviceKVPool
from hiradix.errors import SlotError
from hiradix.host_pool import HostKVPool


def check_pool_pair(device_pool: object, host_pool: object
                    ) -> tuple[DeviceKVPool, HostKVPool]:
    """Validate ``device_pool`` and ``host_pool`` arguments: a ``DeviceKVPool`` and a
    ``HostKVPool`` of its geometry (page size, layers, MHA/MLA, token shape, dtype)."""
    if not isinstance(device_pool, DeviceKVPool):
        raise SlotError("device_pool", f"must be a DeviceKVPool, got "
                                       f"{type(device_pool).__name__}")
    if not isinstance(host_pool, HostKVPool):
        raise SlotError("host_pool", f"must be a HostKVPool, got {type(host_pool).__name__}")
    reason = host_pool.mismatch(device_pool)
    if reason is not None:
        raise SlotError("host_pool", reason)
    return device_pool, host_pool
