"""The disk KV tier (``--kv-offload-dir`` with ``--kv-offload-disk-size``): prefix blocks as
files, so a prefix cache survives a restart (llama.cpp's slot save and LMCache's local disk
do the same job).

One record per block, named by its chained block hash (which covers the model, weights,
dtypes, scales, block size and a request's salt): a header (magic, format version, the
hash, its parent's, the token ids, the page layout: tensor dtypes and shapes, and the
payload's sha256) and the payload (each layer's page tensors as stored: K, V and
per-token scales of quantized pages, byte for byte). A record is written under a
temporary name and renamed, so a partial write is never visible; a record that fails any
check on reading (truncated, bit-flipped, another layout, another hash) is a miss, counted
and logged once, and removed. One engine at a time owns a directory (an exclusive lock; a
second gets a clear error). A disk that fills stops disk writes with one warning.

Plain file I/O and bytes; the tier's bookkeeping is a :class:`~pagedkv.connectors.offload.tier_index.TierIndex`
rebuilt from the records' headers at start (chains prefix-closed; orphans removed).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import struct
import warnings
from pathlib import Path

import torch

MAGIC, VERSION = b"PKVB", 1
SUFFIX = ".kvb"
_HEAD = struct.Struct("<4sII")  # magic, version, header length
MAX_HEADER_BYTES = 1 << 20  # a header holds a block's token ids and layout: a few KB


class RecordError(ValueError):
    """A record failed a check (it is then a miss)."""


def layout(tensors: list[torch.Tensor]) -> list[list]:
    """The per-page layout of a block's tensors: ``[[dtype, shape], ...]``."""
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]


def encode(block_hash: bytes, parent: bytes, token_ids: tuple[int, ...], tensors: list[torch.Tensor]) -> bytes:
    """One record: header then payload (the tensors' bytes, in order)."""
    payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
    header = json.dumps({"hash": block_hash.hex(), "parent": parent.hex(), "tokens": list(token_ids),
                         "layout": layout(tensors), "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    return _HEAD.pack(MAGIC, VERSION, len(header)) + header + payload


def read_header(data: bytes) -> tuple[dict, int]:
    """The header of a record and where its payload starts.

    Raises:
        RecordError: not a record of this format version.
    """
    if len(data) < _HEAD.size:
        raise RecordError("truncated header")
    magic, version, n = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION or len(data) < _HEAD.size + n:
        raise RecordError(f"not a version-{VERSION} record")
    try:
        return json.loads(data[_HEAD.size:_HEAD.size + n]), _HEAD.size + n
    except (ValueError, RecursionError, MemoryError):  # (a header nested 10^5 deep is a bad record too)
        raise RecordError("unreadable header") from None


def decode(data: bytes, block_hash: bytes, token_ids: tuple[int, ...], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of a record, checked against the hash, tokens and layout expected.

    Raises:
        RecordError: any mismatch, a short payload or a wrong checksum.
    """
    head, start = read_header(data)
    payload = data[start:]
    if head.get("hash") != block_hash.hex() or tuple(head.get("tokens", ())) != tuple(token_ids):
        raise RecordError("another block")
    if head.get("layout") != layout(like):
        raise RecordError("another page layout (model, dtype or block size)")
    if hashlib.sha256(payload).hexdigest() != head.get("sha256"):
        raise RecordError("checksum mismatch")
    out, at = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        if at + n > len(payload):
            raise RecordError("short payload")
        out.append(torch.frombuffer(bytearray(payload[at:at + n]), dtype=torch.uint8).view(t.dtype).view(t.shape))
        at += n
    return out


def check_header(head) -> None:
    """Raise RecordError unless ``head`` has a 32-byte hash and parent (hex) and int token ids."""
    ok = (isinstance(head, dict)
          and all(isinstance(head.get(k), str) and len(head[k]) == 64 for k in ("hash", "parent"))
          and isinstance(head.get("tokens"), list) and all(type(t) is int for t in head["tokens"]))
    if ok:
        try:
            bytes.fromhex(head["hash"]), bytes.fromhex(head["parent"])
        except ValueError:
            ok = False
    if not ok or head["hash"] == head["parent"]:
        raise RecordError("malformed header")


def _quiet_unlink(path: Path) -> None:
    """Remove a file if possible (a read-only or vanished directory is not an error here)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _in_use(path: Path) -> ValueError:
    return ValueError(f"--kv-offload-dir {path} is in use by another engine (one engine per directory)")


def check_directory_free(path: str | Path) -> None:
    """Raise the ValueError :class:`DiskDirectory` would if another engine holds ``path``'s
    lock, without taking it: lets an engine refuse before it loads its model."""
    lock = Path(path).expanduser() / "lock"
    try:
        f = open(lock, "a+")  # noqa: SIM115 - closed below
    except OSError:
        return  # no directory yet, or not writable: DiskDirectory says which
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise _in_use(lock.parent.resolve()) from None
    finally:
        f.close()  # (drops the probe's lock)


class DiskDirectory:
    """The records in one directory, owned by this engine (an exclusive ``flock``).

    Raises:
        ValueError: the directory cannot be created or written, or another engine holds it.
    """

    def __init__(self, path: str | Path) -> None:
        if not str(path).strip():
            raise ValueError("--kv-offload-dir is empty")
        self.path = Path(path).expanduser().resolve()  # a later chdir must not move it
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
            self._lock = open(self.path / "lock", "a+")  # noqa: SIM115 - held for the engine's life
        except OSError as e:
            raise ValueError(f"--kv-offload-dir {self.path} is not a writable directory ({e.strerror})") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise _in_use(self.path) from None
        self.writable = True
        self.num_corrupt = 0
        self._warned: set[str] = set()
        for tmp in self.path.glob(".*" + SUFFIX + ".tmp*"):  # left by a writer that died mid-write
            _quiet_unlink(tmp)

    def close(self) -> None:
        """Release the directory (another engine may then open it)."""
        if not self._lock.closed:
            self._lock.close()  # closing the file drops the flock

    @property
    def closed(self) -> bool:
        return self._lock.closed

    def __del__(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None and not lock.closed:
            lock.close()

    def file(self, block_hash: bytes) -> Path:
        return self.path / (block_hash.hex() + SUFFIX)

    def headers(self) -> list[dict]:
        """The headers of every readable record (unreadable ones are removed and counted)."""
        out = []
        for f in sorted(self.path.glob("*" + SUFFIX)):
            try:
                if not stat.S_ISREG(f.lstat().st_mode):  # a pipe would block the start, a link lead elsewhere
                    raise RecordError("not a regular file")
                with open(f, "rb") as fh:
                    head = fh.read(_HEAD.size)
                    n = _HEAD.unpack(head)[2] if len(head) == _HEAD.size else 0
                    if n > MAX_HEADER_BYTES:  # (a real one is a few KB: never read gigabytes for it)
                        raise RecordError("header length out of range")
                    header, _ = read_header(head + fh.read(n))
                check_header(header)
                if header["hash"] + SUFFIX != f.name:
                    raise RecordError("file name and hash differ")
                out.append(header)
            except (OSError, RecordError, struct.error):
                self.corrupt(f, "unreadable record")
        return out

    def write(self, block_hash: bytes, record: bytes) -> bool:
        """Write a record atomically; False (and disk writes stop, with one warning) when
        the disk is full or the directory stops accepting writes."""
        if not self.writable:
            return False
        target = self.file(block_hash)
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(record)  # owner-only: records hold prompt token ids
            os.replace(tmp, target)
            return True
        except (IsADirectoryError, NotADirectoryError) as e:  # something else holds that one name: skip it
            _quiet_unlink(tmp)
            self.corrupt(target, f"a non-file in the way ({e.strerror})", remove=False)
            return False
        except OSError as e:
            _quiet_unlink(tmp)
            self.writable = False
            warnings.warn(f"pagedkv: KV disk tier writes stopped ({e.strerror}); the engine goes on without them",
                          RuntimeWarning, stacklevel=2)
            return False

    def read(self, block_hash: bytes) -> bytes | None:
        f = self.file(block_hash)
        try:
            return f.read_bytes() if stat.S_ISREG(f.lstat().st_mode) else None
        except OSError:
            return None

    def remove(self, block_hash: bytes) -> None:
        _quiet_unlink(self.file(block_hash))

    def corrupt(self, f: Path, why: str, remove: bool = True) -> None:
        """Count and remove a record that failed a check (an empty directory too); log each
        reason once."""
        self.num_corrupt += 1
        if remove:
            _quiet_unlink(f)
            if f.is_dir() and not f.is_symlink():
                with contextlib.suppress(OSError):
                    f.rmdir()
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"pagedkv: KV disk tier: {why} in {f.name}: treated as a miss", RuntimeWarning, stacklevel=2)
