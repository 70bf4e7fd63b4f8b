"""The disk KV tier (issue 12: ``kv_offload_dir``): a prefix cache that survives a restart
with bit-identical output; checked records (truncated, bit-flipped, another layout: a miss,
recomputed); one engine per directory; a full disk stops writes, not the engine."""

from __future__ import annotations

import errno
import gc

import pytest
import torch

from pagedkv import SamplingParams
from pagedkv.connectors.offload.disk_records import RecordError, decode, encode
from pagedkv.kv.hashing import ROOT_HASH

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)


def _prompt(n: int) -> list[int]:
    return list(range(900, 900 + n))


def _run(llm, ids):
    o = llm.generate([{"prompt_token_ids": ids}], PARAMS)[0]
    return o.token_ids, o.logprobs


def _tiered(factory, path, **kw):
    return factory(num_blocks=12, batch_invariant=True, kv_offload_memory=16 * 8192, kv_offload_dir=str(path), **kw)


def _hits(llm) -> int:
    """Prompt tokens found so far: device prefix cache, CPU tier and disk tier."""
    s = llm.engine.stats()
    return s.prefix_cache_hits + s.kv_offload["hit_tokens"] + s.kv_offload["disk_hit_tokens"]


def _restart() -> None:
    gc.collect()  # after `del engine`: the directory's lock goes with the engine


def _records_of_prompt_40(factory, path):
    """The reference output of ``_prompt(40)``, after an engine wrote its records to
    ``path`` and released the directory."""
    want = _run(factory(num_blocks=64, batch_invariant=True, enable_prefix_caching=False), _prompt(40))
    first = _tiered(factory, path)
    assert _run(first, _prompt(40)) == want
    del first
    _restart()
    return want


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_a_restarted_engine_serves_prefixes_from_disk_with_identical_output(tiny_llm_factory, tmp_path, kv_dtype):
    ref = tiny_llm_factory(num_blocks=64, batch_invariant=True, enable_prefix_caching=False, kv_cache_dtype=kv_dtype)
    lengths = (1, 15, 16, 17, 33, 64)
    want = {n: _run(ref, _prompt(n) if n != 64 else list(range(2000, 2064))) for n in lengths}
    first = _tiered(tiny_llm_factory, tmp_path, kv_cache_dtype=kv_dtype)
    for n in lengths:
        assert _run(first, _prompt(n) if n != 64 else list(range(2000, 2064))) == want[n]
    s = first.engine.stats().kv_offload
    first.close()  # finishes the disk writes (no step waits for them) and releases the directory
    assert len(list(tmp_path.glob("*.kvb"))) == s["blocks_saved"] >= 4  # every block the CPU tier got reached disk
    del first
    _restart()
    second = _tiered(tiny_llm_factory, tmp_path, kv_cache_dtype=kv_dtype)
    assert second.engine.stats().kv_offload["disk_blocks_used"] == s["blocks_saved"]
    for n in lengths:
        before = _hits(second)
        assert _run(second, _prompt(n) if n != 64 else list(range(2000, 2064))) == want[n], n
        assert _hits(second) - before == 16 * ((n - 1) // 16), n  # nothing recomputed that a tier had
    assert second.engine.stats().kv_offload["disk_blocks_loaded"] > 0


def test_records_round_trip_byte_for_byte_and_any_damage_is_refused():
    like = [torch.randn(16, 2, 16), torch.randint(-127, 127, (16, 2, 16), dtype=torch.int8),
            torch.randn(16, 2).to(torch.bfloat16)]
    h, tokens = b"\x01" * 32, tuple(range(16))
    rec = encode(h, ROOT_HASH, tokens, like)
    back = decode(rec, h, tokens, like)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(like, back))
    flipped = bytearray(rec)
    flipped[-5] ^= 0x10
    for bad, why in ((rec[:-3], "short|checksum"), (bytes(flipped), "checksum"), (rec[:10], "truncated|version")):
        with pytest.raises(RecordError, match=why):
            decode(bad, h, tokens, like)
    with pytest.raises(RecordError, match="another block"):
        decode(rec, b"\x02" * 32, tokens, like)
    with pytest.raises(RecordError, match="layout"):
        decode(rec, h, tokens, [t.float() for t in like])


@pytest.mark.filterwarnings("ignore:pagedkv. KV disk tier. unreadable record")
def test_a_damaged_record_is_a_miss_and_the_output_stays_right(tiny_llm_factory, tmp_path):
    want = _records_of_prompt_40(tiny_llm_factory, tmp_path)
    records = sorted(tmp_path.glob("*.kvb"))
    assert len(records) == 2
    for f in records:  # flip a payload bit in both: the header still reads, the checksum fails
        data = bytearray(f.read_bytes())
        data[-1] ^= 0x01
        f.write_bytes(bytes(data))
    second = _tiered(tiny_llm_factory, tmp_path)
    with pytest.warns(RuntimeWarning, match="checksum mismatch"):
        assert _run(second, _prompt(40)) == want
    s = second.engine.stats().kv_offload
    assert s["disk_corrupt_records"] >= 1 and s["disk_blocks_loaded"] == 0
    del second
    _restart()
    (tmp_path / "junk.kvb").write_bytes(b"PKVB\x01")  # truncated: dropped when the index is rebuilt
    third = _tiered(tiny_llm_factory, tmp_path)
    assert not (tmp_path / "junk.kvb").exists() and third.engine.stats().kv_offload["disk_corrupt_records"] >= 1


def _chain_order(path) -> list:
    """The record files of one prompt's chain, head first (by their headers' parents)."""
    from pagedkv.connectors.offload.disk_records import read_header

    by_parent = {read_header(f.read_bytes())[0]["parent"]: f for f in path.glob("*.kvb")}
    chain, parent = [], ROOT_HASH.hex()
    while parent in by_parent:
        f = by_parent.pop(parent)
        chain.append(f)
        parent = read_header(f.read_bytes())[0]["hash"]
    return chain


@pytest.mark.filterwarnings("ignore:pagedkv. KV disk tier. unreadable record")
def test_a_corrupt_record_heals_the_recomputed_blocks_reach_the_tiers_again(tiny_llm_factory, tmp_path):
    """Issue 51: flip a payload bit in record 3 of 7. The output stays right and the record
    is counted; the blocks recomputed after it are saved like any other, so the next
    restart serves all 7 from disk again (it found 2 before: the failed step's saves were
    dropped and the retry's plan started at the rolled-back block, past a gap)."""
    ids = _prompt(120)  # 7 full blocks of 16
    want = _run(tiny_llm_factory(num_blocks=64, batch_invariant=True, enable_prefix_caching=False), ids)
    first = _tiered(tiny_llm_factory, tmp_path)
    assert _run(first, ids) == want
    del first
    _restart()
    chain = _chain_order(tmp_path)
    assert len(chain) == 7
    data = bytearray(chain[3].read_bytes())
    data[-1] ^= 0x01  # the header still reads, the checksum fails
    chain[3].write_bytes(bytes(data))
    second = _tiered(tiny_llm_factory, tmp_path)
    with pytest.warns(RuntimeWarning, match="checksum mismatch"):
        assert _run(second, ids) == want
    s = second.engine.stats().kv_offload
    assert s["disk_corrupt_records"] == 1
    assert s["disk_hit_tokens"] == 3 * 16  # what was loaded and used, not the blocks after the bad one
    del second
    _restart()
    assert len(_chain_order(tmp_path)) == 7
    third = _tiered(tiny_llm_factory, tmp_path)
    assert _run(third, ids) == want
    assert third.engine.stats().kv_offload["disk_hit_tokens"] == 7 * 16


def test_one_engine_per_directory_and_unwritable_directories_fail_at_start(tiny_llm_factory, tmp_path):
    first = _tiered(tiny_llm_factory, tmp_path)
    with pytest.raises(ValueError, match="in use by another engine"):
        _tiered(tiny_llm_factory, tmp_path)
    from pagedkv.engine import engine as engine_mod  # refused before the model loads

    loads = []
    real = engine_mod.build_parts
    engine_mod.build_parts = lambda *a, **k: loads.append(1) or real(*a, **k)
    try:
        with pytest.raises(ValueError, match="in use by another engine"):
            _tiered(tiny_llm_factory, tmp_path)
    finally:
        engine_mod.build_parts = real
    assert loads == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a writable directory"):
        _tiered(tiny_llm_factory, tmp_path / "file")
    with pytest.raises(ValueError, match=r"set kv_offload_memory \(--kv-offload-memory\) too"):
        tiny_llm_factory(kv_offload_dir=str(tmp_path / "d"))
    del first


def test_a_full_disk_stops_disk_writes_not_the_engine(tiny_llm_factory, tmp_path, monkeypatch):
    import pagedkv.connectors.offload.disk_records as disk_tier

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    llm = _tiered(tiny_llm_factory, tmp_path)
    monkeypatch.setattr(disk_tier.os, "replace", full)
    with pytest.warns(RuntimeWarning, match="writes stopped"):
        first = _run(llm, _prompt(40))
        llm.engine.runner.connector.disk.drain()  # disk writes end off the steps
    assert _run(llm, _prompt(50))[0] and len(first[0]) == 5
    assert not list(tmp_path.glob("*.kvb")) and not list(tmp_path.glob(".*tmp*"))
    assert llm.engine.stats().kv_offload["disk_blocks_written"] == 0


def test_disk_counters_reach_prometheus(tiny_llm_factory, tmp_path):
    from pagedkv.server.metrics import ServerMetrics

    llm = _tiered(tiny_llm_factory, tmp_path)
    _run(llm, _prompt(40))
    text = ServerMetrics(llm.engine.stats).render().decode()
    assert 'pagedkv_kv_offload_blocks{state="used",tier="disk"} 2.0' in text
    assert 'pagedkv_kv_offload_blocks_saved_total{tier="disk"} 2.0' in text
    assert 'pagedkv_kv_offload_corrupt_records_total{tier="disk"} 0.0' in text


# ---- found by a break-it pass -------------------------------------------------------------
def test_saving_a_block_never_evicts_the_parent_it_chains_from(tiny_llm_factory):
    """A full one-block tier: the next block's save may not evict its own parent (that left
    the tier without the chain's head and crashed the step)."""
    ref = tiny_llm_factory(num_blocks=64, batch_invariant=True, enable_prefix_caching=False)
    for policy in ("lru", "lfu"):
        llm = tiny_llm_factory(num_blocks=16, batch_invariant=True, kv_offload_memory=8192, kv_offload_policy=policy)
        ids = _prompt(20)
        params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=2)
        prompt = [{"prompt_token_ids": ids}]
        got, want = llm.generate(prompt, params)[0], ref.generate(prompt, params)[0]
        assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
        llm.engine.scheduler.connector.check_invariants()


def test_a_record_lost_while_running_never_poisons_the_cpu_tier(tiny_llm_factory, tmp_path):
    """A disk load that fails leaves a page unwritten: nothing that step saved may be kept,
    or the garbage would be served (and written to disk) later."""
    want = _records_of_prompt_40(tiny_llm_factory, tmp_path)
    second = _tiered(tiny_llm_factory, tmp_path)
    for f in tmp_path.glob("*.kvb"):
        f.unlink()  # gone while the engine runs: the loads fail
    with pytest.warns(RuntimeWarning, match="missing record"):
        assert _run(second, _prompt(40)) == want
    for other in (list(range(5000 + 100 * i, 5060 + 100 * i)) for i in range(3)):
        _run(second, other)  # push the prompt out of the 12-block device cache
    hits = second.engine.stats().kv_offload["hit_tokens"]
    assert _run(second, _prompt(40)) == want  # from the CPU tier now: must be the recomputed pages
    assert second.engine.stats().kv_offload["hit_tokens"] == hits + 32


@pytest.mark.parametrize("damage", ["parent-hex", "no-tokens", "tokens-int", "list", "dir"])
def test_a_malformed_header_is_a_miss_not_a_failed_start(tiny_llm_factory, tmp_path, damage):
    import json as _json
    import struct

    first = _tiered(tiny_llm_factory, tmp_path)
    _run(first, _prompt(40))
    del first
    _restart()
    f = sorted(tmp_path.glob("*.kvb"))[0]
    if damage == "dir":
        (tmp_path / "sub.kvb").mkdir()
    else:
        data = f.read_bytes()
        n = struct.unpack_from("<I", data, 8)[0]
        head = _json.loads(data[12:12 + n])
        head = {"parent-hex": head | {"parent": "zz" + head["parent"][2:]}, "no-tokens": {k: v for k, v in head.items()
                if k != "tokens"}, "tokens-int": head | {"tokens": 5}, "list": [head]}[damage]
        raw = _json.dumps(head).encode()
        f.write_bytes(data[:8] + struct.pack("<I", len(raw)) + raw + data[12 + n:])
    with pytest.warns(RuntimeWarning):
        second = _tiered(tiny_llm_factory, tmp_path)
    assert _run(second, _prompt(40))[0]


def test_a_relative_directory_is_resolved_at_start(tiny_llm_factory, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    llm = tiny_llm_factory(num_blocks=12, kv_offload_memory=16 * 8192, kv_offload_dir="rel")
    monkeypatch.chdir("/")
    _run(llm, _prompt(40))
    assert len(list((tmp_path / "rel").glob("*.kvb"))) == 2
    with pytest.raises(ValueError, match="empty"):
        tiny_llm_factory(kv_offload_memory=16 * 8192, kv_offload_dir=" ")


def test_a_dead_writers_temporary_files_are_cleared_and_a_disk_size_needs_a_directory(tiny_llm_factory, tmp_path):
    (tmp_path / ".ab.kvb.tmp123").write_bytes(b"partial")
    llm = _tiered(tiny_llm_factory, tmp_path)
    assert not (tmp_path / ".ab.kvb.tmp123").exists() and llm.engine.stats().kv_offload["disk_capacity_blocks"] > 0
    with pytest.raises(ValueError, match="set kv_offload_dir"):
        tiny_llm_factory(kv_offload_memory="1MiB", kv_offload_disk_size="1GiB")


def test_records_are_owner_only_and_the_server_names_its_tiers(tiny_llm_factory, tmp_path):
    import stat

    from pagedkv.server.cli import _tiers

    llm = _tiered(tiny_llm_factory, tmp_path)
    _run(llm, _prompt(40))
    modes = {stat.S_IMODE(f.stat().st_mode) for f in tmp_path.glob("*.kvb")}
    assert modes == {0o600}
    assert _tiers(llm.engine.stats()) == "; KV tiers: cpu 16 blocks, disk 262,144 blocks (2 found)"
    assert _tiers(tiny_llm_factory().engine.stats()) == ""


def test_no_step_waits_for_a_disk_write_and_close_finishes_them(tiny_llm_factory, tmp_path, monkeypatch):
    import threading

    from pagedkv.connectors.offload.disk_records import DiskDirectory

    gate, write = threading.Event(), DiskDirectory.write

    def held_write(self, *a, **k):
        gate.wait(30)
        return write(self, *a, **k)
    monkeypatch.setattr(DiskDirectory, "write", held_write)
    llm = _tiered(tiny_llm_factory, tmp_path)
    assert len(_run(llm, _prompt(40))[0]) == 5  # the steps ran while every disk write was held
    assert not list(tmp_path.glob("*.kvb")) and not gate.is_set()
    gate.set()
    llm.close()
    assert len(list(tmp_path.glob("*.kvb"))) == 2  # 40 tokens + 4 written outputs: 2 full blocks
    c = llm.engine.scheduler.connector
    assert llm.engine.stats().kv_offload["disk_blocks_written"] == 2  # close reported them
    assert c.index.num_pinned == 0 and not c.disk.writing and all(e.ready for e in c.disk.index.entries.values())
    del llm
    _restart()
    again = _tiered(tiny_llm_factory, tmp_path)  # the directory was released
    assert again.engine.stats().kv_offload["disk_blocks_used"] == 2


def test_a_damaged_records_descendants_are_removed_with_it(tiny_llm_factory, tmp_path):
    from pagedkv.connectors.offload.disk_records import read_header

    want = _records_of_prompt_40(tiny_llm_factory, tmp_path)
    heads = {f: read_header(f.read_bytes())[0] for f in tmp_path.glob("*.kvb")}
    (head,) = [f for f, h in heads.items() if bytes.fromhex(h["parent"]) == ROOT_HASH]
    data = bytearray(head.read_bytes())
    data[-1] ^= 0x01  # the chain's first block fails its checksum: the second is unreachable
    head.write_bytes(bytes(data))
    (child,) = [f for f in heads if f != head]
    second = _tiered(tiny_llm_factory, tmp_path)
    ids = _prompt(16) + list(range(5000, 5020))  # shares only the first block: the child is never rewritten
    ref = tiny_llm_factory(num_blocks=64, batch_invariant=True, enable_prefix_caching=False)
    with pytest.warns(RuntimeWarning, match="checksum mismatch"):
        assert _run(second, ids) == _run(ref, ids)
    second.close()
    assert want and not child.exists()  # unreachable past the gap: its record went with its parent's


def test_close_writes_the_blocks_the_last_step_filled(tiny_llm_factory, tmp_path):
    llm = _tiered(tiny_llm_factory, tmp_path)
    o = llm.generate([{"prompt_token_ids": _prompt(32)}], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert len(o.token_ids) == 1  # the only step filled both blocks; no later step planned their writes
    llm.close()
    assert len(list(tmp_path.glob("*.kvb"))) == 2
    del llm
    _restart()
    assert _tiered(tiny_llm_factory, tmp_path).engine.stats().kv_offload["disk_blocks_used"] == 2


def test_tier_sizes_and_directories_are_checked_with_clear_errors(tmp_path):
    """Issue 51: ``kv_offload_memory=True`` was one byte; a NUL in ``kv_offload_dir`` surfaced
    as Python's raw 'embedded null byte'."""
    from pagedkv.config import EngineConfig

    with pytest.raises(ValueError, match="a size is a byte count"):
        EngineConfig(kv_offload_memory=True)
    with pytest.raises(ValueError, match="kv_offload_dir .* must be a non-empty directory path"):
        EngineConfig(kv_offload_memory="1MiB", kv_offload_dir=str(tmp_path) + "\0x")
    assert EngineConfig(kv_offload_memory="1MiB", kv_offload_dir=tmp_path).kv_offload_dir == str(tmp_path)


def test_a_pipe_or_a_deeply_nested_header_named_like_a_record_is_a_miss(tiny_llm_factory, tmp_path):
    """Issue 51's break-it pass: a named pipe called ``*.kvb`` hung the start (a blocking
    open), a header of 10^5 nested brackets crashed it (RecursionError): both are bad
    records now, counted and passed over."""
    import os
    import struct

    os.mkfifo(tmp_path / ("8" * 64 + ".kvb"))
    (tmp_path / ("7" * 64 + ".kvb")).write_bytes(b"PKVB" + struct.pack("<II", 1, 10**5) + b"[" * 10**5)
    llm = _tiered(tiny_llm_factory, tmp_path)
    assert llm.engine.stats().kv_offload["disk_corrupt_records"] == 2
    assert _run(llm, _prompt(20))[0]


def test_two_checkpoints_that_share_names_sizes_and_times_are_other_weights(tmp_path):
    """Copies that keep their timestamps (``cp -p``, images with fixed mtimes) of two
    different checkpoints under the same folder name: their weights versions, part of every
    block hash, differ, so neither is served the other's KV."""
    import os

    from conftest import make_hf_folder

    from pagedkv.model.loader import resolve_model

    folders = []
    for seed, where in ((1, "a"), (2, "b")):
        folder = tmp_path / where / "model"
        folder.mkdir(parents=True)
        make_hf_folder(folder, seed=seed)
        for f in folder.iterdir():
            os.utime(f, ns=(10**18, 10**18))
        folders.append(folder)
    a, b = (resolve_model(str(f)) for f in folders)
    assert a.folder.name == b.folder.name and a.weights_version != b.weights_version


def test_a_directory_named_like_a_record_costs_that_record_only(tiny_llm_factory, tmp_path):
    """Issue 51's second break-it pass: a directory in a record's place stopped every disk
    write for the engine's life (os.replace onto it failed, read as a full disk); a record
    whose header claims gigabytes was read whole at start. Now that one block is skipped,
    the others are written, and the giant header is refused unread."""
    import struct

    first = _tiered(tiny_llm_factory, tmp_path)
    _run(first, _prompt(40))
    first.close()
    del first
    _restart()
    victim = sorted(tmp_path.glob("*.kvb"))[0]
    victim.unlink()
    victim.mkdir()
    (victim / "keep").write_bytes(b"x")  # not empty: it cannot be removed
    with open(tmp_path / ("6" * 64 + ".kvb"), "wb") as f:
        f.write(b"PKVB" + struct.pack("<II", 1, 0xFFFFFFFF))
        f.truncate(64 << 20)  # sparse: a header length of 4 GiB over a 64 MiB file
    llm = _tiered(tiny_llm_factory, tmp_path)
    with pytest.warns(RuntimeWarning, match="non-file in the way"):
        _run(llm, _prompt(40))
    _run(llm, list(range(3000, 3040)))  # another prompt: its blocks reach the disk
    llm.close()
    stats = llm.engine.stats().kv_offload
    assert stats["disk_blocks_written"] >= 2 and stats["disk_corrupt_records"] >= 2
    assert victim.is_dir() and not (tmp_path / ("6" * 64 + ".kvb")).exists()
