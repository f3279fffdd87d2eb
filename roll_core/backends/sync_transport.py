"""The weight-sync data plane, as it runs inside the ranks (never in the driver).

It lives in backends/ (below workers/ and engine/) because inference backends join the group
themselves: the vLLM worker extension runs in the engine's own processes. The driver side,
which picks the path and says when to sync, is roll_core/engine/weight_sync.py.

One group per (actor_train, actor_infer) pair: actor_train rank 0 (group rank 0, the sender)
and every receiving endpoint of actor_infer (an hf rank, or each vLLM worker process, which
joins itself through ``collective_rpc``). The group is built from its own
``torch.distributed.TCPStore`` and a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL``
(every member on CUDA), so it never touches the default group the fsdp2 / deepspeed ranks
already share. Every collective waits with the recipe's ``sync.timeout_s``.

The sender streams buckets of at most ``bucket_bytes`` (a tensor larger than a bucket goes
alone). Per bucket it broadcasts a header ``[kind, meta_len]`` and the metadata (names,
dtypes, shapes, byte offsets; pickled, between our own processes), then the bytes travel one
of three ways (the ``mode``):

* ``broadcast``: one broadcast of the packed bucket (over TCP with gloo, NVLink/IB with NCCL);
* ``shared_memory`` (CPU, one host): the sender packs the bucket into a ``/dev/shm`` file the
  receivers map and copy from; a tiny all-reduce (the ack) then tells the sender every
  receiver is done, and only then is the file refilled;
* ``cuda_ipc`` (GPU, one host): like ``shared_memory`` with a CUDA buffer shared by an IPC
  handle (torch.multiprocessing.reductions). Written, not run in CI: no GPU there.

Buffer reuse: the broadcast modes wait on each collective's work handle before the buffer is
packed again (the collective's contract: the root's buffer is free once its work completes;
NCCL orders the next pack after it on the stream); the shared modes wait for the ack.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from roll_core.errors import RollError

_ALIGN = 64
_END, _BUCKET = 0, 1
MODES = ("broadcast", "shared_memory", "cuda_ipc")

Named = list[tuple[str, torch.Tensor]]


def endpoint(device: str | torch.device) -> dict[str, Any]:
    """Where a group member lives: host, process id and device type (for the path choice)."""
    return {
        "host": socket.gethostname(),
        "boot": _boot_id(),
        "pid": os.getpid(),
        "device": torch.device(device).type,
        "gpu": _gpu_uuid(torch.device(device)),
        "shm_free": shm_free(),
    }


def _gpu_uuid(device: torch.device) -> str:
    """The physical GPU behind `device` ("" on CPU): CUDA IPC needs the sender's GPU."""
    if device.type != "cuda":
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Named]:
    """Group a stream of tensors into buckets of at most `bucket_bytes` (aligned layout); a
    tensor larger than a bucket is a bucket of its own. Lazy: holds one bucket at a time."""
    bucket: Named = []
    size = 0
    for name, t in named:
        n = _aligned(t.numel() * t.element_size())
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _layout(items: Named) -> tuple[list[tuple[str, str, tuple[int, ...], int, int]], int]:
    meta, offset = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        meta.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += _aligned(nbytes)
    return meta, offset


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _used(meta: list[Any]) -> int:
    """Bytes a bucket occupies up to the end of its last tensor (no trailing padding)."""
    return int(meta[-1][3] + meta[-1][4])


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _views(buf: torch.Tensor, meta: list[Any]) -> Named:
    return [
        (name, buf[off : off + nbytes].view(getattr(torch, dtype)).view(shape))
        for name, dtype, shape, off, nbytes in meta
    ]


SHM_DIR = "/dev/shm"


def shm_free() -> int:
    """Free bytes in /dev/shm (0 when there is none)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _check_room(size: int, what: str) -> None:
    """Refuse a /dev/shm file that does not fit: writing past tmpfs's size is a SIGBUS."""
    free = shm_free()
    if size > free:
        raise RollError(
            f"weight sync: {what} needs {size / 2**20:.0f} MiB of /dev/shm, which has "
            f"{free / 2**20:.0f} MiB free.",
            hint="Lower sync.bucket_mb, set sync.path=broadcast, or give the container more "
            "shared memory (docker --shm-size, Ray's object store shares it too).",
        )


def _map(path: str, size: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


class ParameterArena:
    """CPU parameters moved into one /dev/shm file (their `.data` rebound to views of it; the
    optimizer, which holds the parameter objects, is unaffected), so shared-memory receivers
    copy straight from the trainer's live weights. Removed when the process exits."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        offsets, size = [], 0
        for p in params:
            offsets.append(size)
            size += _aligned(p.numel() * p.element_size())
        if size + (64 << 20) > shm_free():  # keep room for the bucket files
            raise OSError("no room in /dev/shm")
        self.path = f"{SHM_DIR}/roll-sync-params-{uuid.uuid4().hex}"
        self.buf = _map(self.path, max(size, 1))
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        self.size = max(size, 1)
        with torch.no_grad():
            for p, off in zip(params, offsets, strict=True):
                view = self.buf[off : off + p.numel() * p.element_size()]
                view = view.view(p.dtype).view(p.shape)
                view.copy_(p.data)
                p.data = view
        self.base = self.buf.data_ptr()

    def locate(self, t: torch.Tensor) -> int | None:
        """`t`'s byte offset in the arena, or None if it does not live there."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        off = t.data_ptr() - self.base
        if off >= 0 and off + t.numel() * t.element_size() <= self.size:
            return off
        return None


class SyncGroup:
    """This member's handle on the weight-sync group (rank 0 sends, the others receive)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        mode: str,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"weight sync: unknown mode {mode!r}; valid: {', '.join(MODES)}")
        self.rank, self.world_size, self.mode = rank, world_size, mode
        self.timeout = timedelta(seconds=timeout_s)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if (backend == "nccl")
            else torch.device("cpu")
        )
        try:
            store = dist.TCPStore(
                host,
                port,
                world_size,
                is_master=rank == 0,
                timeout=self.timeout,
                wait_for_workers=False,
            )
            self.store = store
            if backend == "nccl":  # written for GPUs; not run in CI (no GPU there)
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self.pg: Any = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            else:
                self.pg = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        except Exception as err:  # noqa: BLE001 - gloo/nccl raise RuntimeError subtypes
            raise RollError(
                f"weight sync: rank {rank} of {world_size} could not join the group at "
                f"{host}:{port} within {timeout_s:g} s ({err})."
            ) from None
        self._buf: torch.Tensor | None = None
        self._buf_id = ""
        self._shm: dict[str, torch.Tensor] = {}
        self._shm_owned: list[str] = []
        self.arena: ParameterArena | None = None
        self._arena_map: tuple[str, torch.Tensor] | None = None
        self._finalizers: list[weakref.finalize] = []
        self._ipc: dict[Any, torch.Tensor] = {}

    # ---- collectives ----------------------------------------------------------------------
    def _broadcast(self, t: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = self.timeout
        try:
            self.pg.broadcast([t], opts).wait(self.timeout)
        except Exception as err:  # noqa: BLE001 - a peer died or timed out
            raise self._failed(what, err) from None

    def _ack(self, what: str) -> None:
        flag = torch.ones(1, device=self.device)
        opts = dist.AllreduceOptions()
        opts.timeout = self.timeout
        try:
            self.pg.allreduce([flag], opts).wait(self.timeout)
        except Exception as err:  # noqa: BLE001
            raise self._failed(what, err) from None

    def _failed(self, what: str, err: BaseException) -> RollError:
        role = "sender (actor_train rank 0)" if self.rank == 0 else f"receiver {self.rank}"
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        return RollError(
            f"weight sync: the {role} failed during {what} (a group member died or did not "
            f"answer within {self.timeout.total_seconds():g} s: {first}).",
            hint="The step fails before its checkpoint; the last checkpoint is intact. Raise "
            "sync.timeout_s if the network is slow.",
        )

    def _send_bytes(self, payload: bytes, kind: int, what: str) -> None:
        header = torch.tensor([kind, len(payload)], dtype=torch.int64, device=self.device)
        self._broadcast(header, f"{what} (header)")
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            self._broadcast(data, f"{what} (metadata)")

    def _recv_bytes(self, what: str) -> tuple[int, bytes]:
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._broadcast(header, f"{what} (header)")
        kind, size = (int(x) for x in header.tolist())
        if not size:
            return kind, b""
        data = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._broadcast(data, f"{what} (metadata)")
        return kind, data.cpu().numpy().tobytes()

    # ---- buffers ----------------------------------------------------------------------------
    def _buffer(self, size: int, device: torch.device) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < size or self._buf.device != device:
            self._buf = torch.empty(size, dtype=torch.uint8, device=device)
            self._buf_id = uuid.uuid4().hex
        return self._buf[:size]

    def _shm_file(self, size: int) -> tuple[str, torch.Tensor]:
        """The sender's /dev/shm buffer of at least `size` bytes, kept from sync to sync (its
        pages stay mapped on both sides); a larger tensor gets a new, larger file. The file's
        name is removed once every receiver has mapped it (after the first ack), or when the
        group closes, the sync fails, or the process exits; the memory goes with the last
        mapping."""
        for path, buf in self._shm.items():
            if buf.numel() >= size:
                return path, buf
        self._unlink_shm()
        _check_room(size, "a sync bucket (sync.bucket_mb)")
        path = f"{SHM_DIR}/roll-sync-{uuid.uuid4().hex}"
        buf = _map(path, size)
        self._shm_owned.append(path)
        self._finalizers.append(weakref.finalize(self, _unlink, path))
        self._shm = {path: buf}
        return path, buf

    def _unlink_shm(self) -> None:
        for path in self._shm_owned:
            _unlink(path)
        self._shm_owned.clear()
        self._shm.clear()

    # ---- the sender's parameters in shared memory ----------------------------------------------
    def adopt(self, params: list[torch.Tensor]) -> bool:
        """`shared_memory` mode, CPU sender: move `params` (live CPU parameters) into one
        /dev/shm file, so receivers copy straight from them (one copy per sync instead of
        pack + copy). Returns False, changing nothing, when /dev/shm has no room."""
        if self.mode != "shared_memory" or not params:
            return False
        try:
            self.arena = ParameterArena(params)
        except OSError:
            return False
        return True

    def _in_arena(self, items: Named) -> list[Any] | None:
        """The bucket's metadata with offsets into the arena, or None if some tensor is not
        an arena parameter (e.g. a LoRA-merged or gathered tensor, or a param moved since)."""
        if self.arena is None:
            return None
        meta = []
        for name, t in items:
            off = self.arena.locate(t)
            if off is None:
                return None
            nbytes = t.numel() * t.element_size()
            meta.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), off, nbytes))
        return meta

    # ---- sender -----------------------------------------------------------------------------
    def send(self, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> dict[str, int]:
        """Stream `named` to every receiver; returns {"bytes", "buckets", "tensors"}."""
        stats = {"bytes": 0, "buckets": 0, "tensors": 0}
        try:
            for k, items in enumerate(buckets(named, bucket_bytes)):
                self._send_bucket(items, f"bucket {k}")
                stats["buckets"] += 1
                stats["tensors"] += len(items)
                stats["bytes"] += sum(t.numel() * t.element_size() for _, t in items)
            self._send_bytes(pickle.dumps(stats), _END, "the end marker")
        except BaseException:
            self._unlink_shm()
            raise
        return stats

    def _send_bucket(self, items: Named, what: str) -> None:
        meta, size = _layout(items)
        info: dict[str, Any] = {"tensors": meta, "size": size}
        if self.mode == "broadcast":
            if len(items) == 1:  # no packing: the tensor's own bytes (e.g. larger than a bucket)
                data = _flat(items[0][1]).to(self.device)
            else:
                data = self._buffer(size, self.device)
                for (_, t), (_, _, _, off, nbytes) in zip(items, meta, strict=True):
                    data[off : off + nbytes].copy_(_flat(t))
            self._send_bytes(pickle.dumps(info), _BUCKET, what)
            self._broadcast(data[: _used(meta)], what)
            return
        if self.mode == "shared_memory":
            located = self._in_arena(items)
            if located is not None:  # the receivers copy straight from the live parameters
                info["tensors"] = located
                info["arena"] = (self.arena.path, self.arena.size)  # type: ignore[union-attr]
                self._send_bytes(pickle.dumps(info), _BUCKET, what)
                self._ack(f"{what} (ack)")
                _unlink(self.arena.path)  # type: ignore[union-attr]  # all have it mapped
                return
            path, buf = self._shm_file(max(size, 1))
            info["shm"] = (path, buf.numel())
        else:  # cuda_ipc: untested here (no GPU)
            from torch.multiprocessing.reductions import reduce_tensor

            buf = self._buffer(max(size, 1), items[0][1].device)
            info["ipc"] = reduce_tensor(self._buf)[1]
            info["ipc_key"] = self._buf_id
        for (_, t), (_, _, _, off, nbytes) in zip(items, meta, strict=True):
            buf[off : off + nbytes].copy_(_flat(t))
        if buf.device.type == "cuda":
            torch.cuda.current_stream(buf.device).synchronize()
        self._send_bytes(pickle.dumps(info), _BUCKET, what)
        self._ack(f"{what} (ack)")  # every receiver has copied: the buffer may be refilled
        if "shm" in info:  # and every receiver has mapped the file: its name can go
            _unlink(info["shm"][0])

    # ---- receiver ---------------------------------------------------------------------------
    def receive(self, load: Callable[[Named], None]) -> dict[str, int]:
        """Receive every bucket and hand its tensors (views into a buffer, valid during the
        call) to `load`; returns the sender's stats."""
        k = 0
        while True:
            kind, payload = self._recv_bytes(f"bucket {k}")
            info = pickle.loads(payload)  # noqa: S301 - from our own actor_train rank 0
            if kind == _END:
                return info
            meta, size = info["tensors"], info["size"]
            if self.mode == "broadcast":
                buf = self._buffer(_used(meta), self.device)
                self._broadcast(buf, f"bucket {k}")
                load(_views(buf, meta))
            elif self.mode == "shared_memory":
                if "arena" in info:
                    path, cap = info["arena"]
                    if self._arena_map is None or self._arena_map[0] != path:
                        self._arena_map = (path, _map(path, cap))
                    load(_views(self._arena_map[1], meta))
                else:
                    path, cap = info["shm"]
                    if path not in self._shm:
                        self._shm = {path: _map(path, cap)}
                    load(_views(self._shm[path][:size], meta))
                self._ack(f"bucket {k} (ack)")
            else:  # cuda_ipc: untested here (no GPU)
                from torch.multiprocessing.reductions import rebuild_cuda_tensor

                key = info["ipc_key"]
                if key not in self._ipc:
                    self._ipc = {key: rebuild_cuda_tensor(*info["ipc"])}
                load(_views(self._ipc[key][:size], meta))
                torch.cuda.current_stream().synchronize()
                self._ack(f"bucket {k} (ack)")
            k += 1

    def close(self) -> None:
        self._unlink_shm()
        self._arena_map = None
        self._ipc.clear()
        self._buf = None
        shutdown = getattr(self.pg, "shutdown", None) or getattr(self.pg, "abort", None)
        if shutdown is not None:
            with contextlib.suppress(Exception):  # best effort on a broken group
                shutdown()
