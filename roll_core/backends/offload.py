"""Moving a role's tensors off its device and back, for roles that take turns on one device.

The mechanism is the one FSDP uses for its unsharded parameters: every tensor keeps its
identity (the optimizer's state keys, the module's attributes, views such as a ZeRO flat
buffer's parameters stay valid), only its *storage* changes. `offload` copies each distinct
storage into a backup buffer (pinned CPU memory when the storage is on a GPU, plain CPU memory
otherwise) and resizes the storage to 0 bytes, which frees it; `reload` resizes it back and
copies the bytes in. The round trip is exact (a byte copy), and the same code runs on CPU,
where the backup is another CPU buffer: the storage is really freed in between (tests assert
`nbytes() == 0`), so the path is exercised without a GPU.

A storage that cannot be resized (a CPU tensor memory-mapped from a safetensors file) is first
given a resizable copy of its own (`rehome`), once. CPU storages in shared memory are left in
place: other processes map them (and they are host memory already).

`device_memory()` measures the memory of the calling process's device: CUDA allocated and
reserved bytes, or the process's resident set size on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

GB = 1024**3


def _byte_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the first `nbytes` of `storage`."""
    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return view.set_(storage, 0, (nbytes,), (1,))  # type: ignore[call-overload]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's data: a DTensor's local shard, else `t` itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def rehome(tensors: list[torch.Tensor]) -> None:
    """Give tensors whose storage is not resizable (memory-mapped) a resizable copy of it;
    tensors that shared a storage share the new one."""
    groups: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        s = t.untyped_storage()
        if not s.resizable() and s.nbytes() and not (s.device.type == "cpu" and s.is_shared()):
            groups.setdefault(s.data_ptr(), []).append(t)
    for group in groups.values():
        old = group[0].untyped_storage()
        new = torch.empty(old.nbytes(), dtype=torch.uint8, device=old.device).untyped_storage()
        _byte_view(new, old.nbytes()).copy_(_byte_view(old, old.nbytes()))
        with torch.no_grad():
            for t in group:
                t.set_(new, t.storage_offset(), t.size(), t.stride())  # type: ignore[call-overload]


@dataclass
class StorageStash:
    """The storages of a set of tensors, moved to backup buffers and back (see module doc)."""

    pin_memory: bool = True
    """On a GPU, back up into pinned CPU memory (faster copies, kept between turns)."""
    _held: list[tuple[torch.UntypedStorage, torch.Tensor]] = field(default_factory=list)
    _buffers: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def offloaded(self) -> bool:
        return bool(self._held)

    def offload(
        self, tensors: Iterable[torch.Tensor], *, device: torch.device | None = None
    ) -> int:
        """Back up and free every distinct storage of `tensors` (with `device`: only those on
        a device of its type; state a backend already keeps in CPU memory, e.g. DeepSpeed's
        offload_optimizer, stays); returns the bytes freed."""
        if self._held:
            raise RuntimeError("StorageStash.offload: already offloaded (reload first)")
        locals_ = [_local(t) for t in tensors if isinstance(t, torch.Tensor)]
        if device is not None:
            locals_ = [t for t in locals_ if t.device.type == device.type]
        rehome(locals_)
        seen: set[int] = set()
        moved = 0
        for t in locals_:
            s = t.untyped_storage()
            n = s.nbytes()
            if n == 0 or s.data_ptr() in seen:
                continue  # already freed (e.g. FSDP's unsharded buffers) or shared
            if s.device.type == "cpu" and s.is_shared():
                continue  # host shared memory that other processes map (e.g. a weight sync)
            seen.add(s.data_ptr())
            key = len(self._held)
            backup = self._buffers.get(key)
            if backup is None or backup.numel() != n:
                pin = self.pin_memory and s.device.type == "cuda"
                backup = torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=pin)
                self._buffers[key] = backup
            backup.copy_(_byte_view(s, n))
            s.resize_(0)
            self._held.append((s, backup))
            moved += n
        if moved and any(s.device.type == "cuda" for s, _ in self._held):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return moved

    def reload(self) -> int:
        """Undo `offload`: every storage back to its size and bytes; returns the bytes."""
        moved = 0
        for s, backup in self._held:
            n = backup.numel()
            s.resize_(n)
            _byte_view(s, n).copy_(backup, non_blocking=backup.is_pinned())
            moved += n
        if any(s.device.type == "cuda" for s, _ in self._held):
            torch.cuda.synchronize()
        self._held = []
        if not self.pin_memory:  # plain buffers are cheap to re-allocate: free them now
            self._buffers = {}
        return moved


def device_memory(device: torch.device | str | None = None) -> dict[str, float]:
    """Memory of this process's device in GiB: CUDA `allocated` and `reserved`, or the
    process's resident set (`rss`) on CPU (psutil when installed, else /proc/self/statm)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        return {
            "allocated_gb": torch.cuda.memory_allocated(dev) / GB,
            "reserved_gb": torch.cuda.memory_reserved(dev) / GB,
        }
    try:
        import psutil

        rss = float(psutil.Process().memory_info().rss)
    except ImportError:
        with open("/proc/self/statm", encoding="ascii") as f:
            rss = float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"rss_gb": rss / GB}
