"""BlobCache and the blob wire format, without a network: verification, atomicity, the trust rule."""

import asyncio
import hashlib
import os
import time

import pytest

from peer.errors import UserError
from peer.network.access import MAX_INVITE_CHARS
from peer.network.blobs.cache import BlobCache, check_sha256
from peer.network.blobs.errors import BlobCorrupt
from peer.network.blobs.wire import (
    MAX_HEADER,
    MAX_REQUEST,
    BlobRequest,
    BlobResponse,
    ProtocolError,
    read_chunk,
    read_header,
)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _files(root, sub):
    return sorted(p for p in (root / sub).rglob("*") if p.is_file())


def _after_timestamp_tick(path):
    """Wait until the filesystem clock has moved past ``path``'s ctime (file timestamps are coarse, ~4 ms)."""
    probe = path.with_name("probe")
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        probe.write_bytes(b"")
        if probe.stat().st_ctime_ns > path.stat().st_ctime_ns:
            probe.unlink()
            return
    raise AssertionError(f"the filesystem clock did not move past {path.stat().st_ctime_ns} in 2 s")


@pytest.fixture
def cache(tmp_path):
    return BlobCache(tmp_path / "cache")


def test_put_bytes_round_trip(cache):
    data = os.urandom(3 * 2**20 + 7)
    sha = cache.put_bytes(data)
    assert sha == _sha(data)
    assert cache.has(sha) and cache.size(sha) == len(data)
    with cache.open(sha) as f:
        assert f.read() == data
    assert cache.path(sha) == cache.root / "objects" / sha[:2] / sha
    assert cache.list() == [sha]
    assert cache.put_bytes(data) == sha  # idempotent
    assert _files(cache.root, "tmp") == []


def test_missing_blob(cache):
    sha = _sha(b"never stored")
    assert not cache.has(sha)
    with pytest.raises(KeyError, match="not in the cache"):
        cache.path(sha)


def test_put_with_wrong_hash_stores_nothing(cache):
    with pytest.raises(BlobCorrupt):
        cache.put_bytes(b"payload", sha256=_sha(b"other"))
    assert not cache.has(_sha(b"payload")) and not cache.has(_sha(b"other"))
    assert _files(cache.root, "objects") == [] and _files(cache.root, "tmp") == []
    assert issubclass(BlobCorrupt, UserError)


def test_put_file_copies_and_hashes(cache, tmp_path):
    src = tmp_path / "model.bin"
    data = os.urandom(2 * 2**20 + 5)
    src.write_bytes(data)
    sha = cache.put_file(src)
    assert sha == _sha(data)
    src.unlink()
    assert cache.path(sha).read_bytes() == data
    other = tmp_path / "other.bin"
    other.write_bytes(b"abc")
    with pytest.raises(BlobCorrupt):
        cache.put_file(other, sha256=_sha(b"xyz"))
    assert not cache.has(_sha(b"abc")) and _files(cache.root, "tmp") == []


def test_adopt_serves_the_file_in_place_and_forgets_it_when_it_changes(cache, tmp_path):
    src = tmp_path / "bundled.safetensors"
    src.write_bytes(b"weights" * 1000)
    sha = cache.adopt(src)
    assert cache.path(sha) == src.resolve()
    assert _files(cache.root, "objects") == []  # nothing copied
    with pytest.raises(BlobCorrupt):
        cache.adopt(src, sha256=_sha(b"something else"))
    with open(src, "ab") as f:
        f.write(b"tampered")
    assert not cache.has(sha)  # size/mtime changed -> re-hashed -> mismatch -> forgotten
    assert src.exists(), "the cache must never delete a file it does not own"
    assert cache.list() == []


def test_adopted_file_touched_but_unchanged_is_rehashed_and_kept(cache, tmp_path):
    src = tmp_path / "f.bin"
    src.write_bytes(b"same bytes")
    sha = cache.adopt(src)
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert cache.has(sha) and cache.path(sha) == src.resolve()


def test_owned_blob_corrupted_on_disk_is_dropped(cache):
    data = os.urandom(100_000)
    sha = cache.put_bytes(data)
    path = cache.path(sha)
    _after_timestamp_tick(path)
    path.write_bytes(bytes(b ^ 1 for b in data[:10]) + data[10:])  # same size
    assert not cache.has(sha)
    assert not path.exists() and cache.list() == []


def test_forged_mtime_is_caught_by_ctime(cache):
    sha = cache.put_bytes(b"a" * 4096)
    path = cache.path(sha)
    st = path.stat()
    _after_timestamp_tick(path)
    path.write_bytes(b"b" * 4096)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime as when it was checked
    assert not cache.has(sha) and not path.exists()


def test_verify_finds_what_a_stat_cannot(cache):
    sha = cache.put_bytes(b"a" * 4096)
    assert cache.verify(sha)
    path = cache.path(sha)
    path.write_bytes(b"b" * 4096)
    cache._write_record(sha, path, owned=True)  # as if the change fell within the same timestamp tick
    assert cache.has(sha), "has() trusts an unchanged stat"
    assert not cache.verify(sha)
    assert not cache.has(sha) and not path.exists()


def test_a_file_named_by_hash_is_trusted_only_after_hashing(cache):
    good = b"planted but correct"
    sha = _sha(good)
    planted = cache.root / "objects" / sha[:2] / sha
    planted.parent.mkdir(parents=True)
    planted.write_bytes(good)
    assert cache.has(sha) and cache.list() == [sha]  # hashed once, then recorded

    liar = _sha(b"what the name claims")
    fake = cache.root / "objects" / liar[:2] / liar
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_bytes(b"different bytes")
    assert not cache.has(liar)
    assert not fake.exists()


def test_incoming_is_invisible_until_commit(cache):
    data = os.urandom(10_000)
    sha = _sha(data)
    with pytest.raises(RuntimeError, match="network died"), cache.incoming(sha, len(data)) as pending:
        pending.write(data[:5000])
        assert not cache.has(sha)
        raise RuntimeError("network died")
    assert not cache.has(sha) and _files(cache.root, "tmp") == []

    with cache.incoming(sha, len(data)) as pending:
        pending.write(data[:5000])
    assert not cache.has(sha) and _files(cache.root, "tmp") == []  # left without commit

    with pytest.raises(BlobCorrupt, match="bytes, expected"), cache.incoming(sha, len(data) + 1) as pending:
        pending.write(data)
        pending.commit()
    with pytest.raises(BlobCorrupt, match="hashes to"), cache.incoming(sha, len(data)) as pending:
        pending.write(data[:-1] + b"\0")
        pending.commit()
    assert not cache.has(sha) and _files(cache.root, "objects") == [] and _files(cache.root, "tmp") == []

    with cache.incoming(sha, len(data)) as pending:
        pending.write(data)
        assert pending.commit() == cache.path(sha)
    assert cache.path(sha).read_bytes() == data


def test_remove_and_stale_parts(cache):
    sha = cache.put_bytes(b"x")
    cache.remove(sha)
    assert not cache.has(sha) and _files(cache.root, "objects") == []
    old, fresh = cache.root / "tmp" / "old.part", cache.root / "tmp" / "fresh.part"
    old.write_bytes(b"1")
    fresh.write_bytes(b"2")
    os.utime(old, (time.time() - 3 * 86400,) * 2)
    BlobCache(cache.root)
    assert not old.exists() and fresh.exists()


@pytest.mark.parametrize("bad", ["A" * 64, "../" + "a" * 61, "a" * 63, 7, None])
def test_check_sha256_refuses_non_hashes(bad):
    with pytest.raises(ValueError):
        check_sha256(bad)


def test_wire_validation():
    sha = "ab" * 32
    assert BlobRequest.from_wire({"sha256": sha, "offset": 3, "length": None}) == BlobRequest(sha, 3, None)
    for bad in ({"sha256": "zz"}, {"sha256": sha, "offset": -1}, {"sha256": sha, "length": True}, {}):
        with pytest.raises(ProtocolError):
            BlobRequest.from_wire(bad)
    assert BlobResponse.from_wire({"ok": True, "size": 5, "length": 5, "error": None}).ok
    with pytest.raises(ProtocolError):
        BlobResponse.from_wire({"ok": 1, "size": 5, "length": 5})
    assert len(BlobResponse(ok=False, error="x" * 10_000).to_wire()["error"]) < 1000
    refusal = BlobResponse(ok=False, error="seeded", hints=("QmA", "QmB"))
    assert BlobResponse.from_wire(refusal.to_wire()) == refusal
    assert "hints" not in BlobResponse(ok=True).to_wire()  # what an older reader sees is unchanged
    for hints in ("QmA", ["QmA"] * 5, ["Qm0"], [""], [7], ["x" * 129]):
        with pytest.raises(ProtocolError, match="hints"):
            BlobResponse.from_wire({"ok": False, "error": "busy", "hints": hints})


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_wire_refuses_oversized_or_garbage_frames():
    async def check():
        with pytest.raises(ProtocolError, match="exceeds"):
            await read_header(_reader((MAX_HEADER + 1).to_bytes(4, "big")))
        with pytest.raises(ProtocolError, match="undecodable|not a map"):
            await read_header(_reader((3).to_bytes(4, "big") + b"\xc1\xc1\xc1"))
        with pytest.raises(ProtocolError, match="exceeds"):
            await read_chunk(_reader((64 << 20).to_bytes(4, "big")))
        assert await read_chunk(_reader(b"\0\0\0\0")) == b""
        with pytest.raises(asyncio.IncompleteReadError):
            await read_chunk(_reader((10).to_bytes(4, "big") + b"short"))

    asyncio.run(check())


def test_the_largest_valid_request_fits_the_request_cap_and_a_larger_header_is_refused_unread():
    import msgpack

    largest = BlobRequest("ab" * 32, 2**64 - 1, 2**64 - 1, "x" * MAX_INVITE_CHARS).to_wire()
    frame = msgpack.packb(largest, use_bin_type=True)
    assert len(frame) <= MAX_REQUEST < MAX_HEADER

    async def check():
        assert await read_header(_reader(len(frame).to_bytes(4, "big") + frame), MAX_REQUEST) == largest
        # only the length prefix is there: the cap is checked before any of the header is awaited
        with pytest.raises(ProtocolError, match=f"exceeds {MAX_REQUEST}"):
            await read_header(_reader((MAX_REQUEST + 1).to_bytes(4, "big")), MAX_REQUEST)

    asyncio.run(check())
