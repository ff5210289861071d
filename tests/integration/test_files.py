"""Files holding secrets are created 0600 (never written first and chmod'ed after) and replaced atomically."""

import json
import os
import stat
from types import SimpleNamespace

import pytest

from peer.files import write_private


@pytest.fixture
def umask_022():
    """The usual umask, under which a plain open() makes files every local user can read."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_write_private_creates_0600_replaces_atomically_and_leaves_no_temporary(tmp_path, umask_022):
    target = tmp_path / "secret.json"
    write_private(target, '{"token": 1}')
    assert mode(target) == 0o600 and target.read_text() == '{"token": 1}'
    readable = tmp_path / "was-public.json"
    readable.write_text("old")
    assert mode(readable) == 0o644
    write_private(readable, b"new")
    assert mode(readable) == 0o600 and readable.read_bytes() == b"new", "an existing file is replaced, not opened"
    write_private(tmp_path / "new" / "dir" / "key", b"k")
    assert mode(tmp_path / "new" / "dir") == 0o700 and mode(tmp_path / "new" / "dir" / "key") == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "secret.json", "was-public.json"]


def test_write_private_keeps_the_old_file_when_writing_fails(tmp_path, umask_022):
    target = tmp_path / "book.json"
    write_private(target, "old")
    with pytest.raises(TypeError):
        write_private(target, 42)  # not bytes: fails inside the write
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["book.json"]


def test_the_signing_key_and_the_invite_book_are_created_0600(tmp_path, umask_022):
    from coordinator.invites import InviteBook
    from peer.network.swarm import load_signing_key

    identity = tmp_path / "keys" / "host.id"
    key = load_signing_key(str(identity))
    rsa = tmp_path / "keys" / "host.id.rsa"
    assert mode(rsa) == 0o600 and mode(tmp_path / "keys") == 0o700
    assert load_signing_key(str(identity)).to_bytes() == key.to_bytes(), "read back, not replaced"
    book = InviteBook(identity, "run-a")
    book.issue("alice")
    assert mode(book.path) == 0o600
    assert [p.name for p in (tmp_path / "keys").iterdir() if p.name.endswith(".tmp")] == []


def test_the_hosts_info_file_is_created_0600(tmp_path, umask_022):
    from coordinator.host import Host

    info = {"run_id": "r", "invite": "hgi1.secret", "coordinator": "0" * 16}
    path = tmp_path / "info.json"
    Host.write_info(SimpleNamespace(info=lambda: info), path)  # the method alone: no swarm needed
    assert mode(path) == 0o600 and json.loads(path.read_text()) == info


def test_the_libp2p_identity_is_created_0600_in_hiveminds_format(tmp_path, umask_022):
    from hivemind.p2p import PeerID

    from peer.network.swarm import create_libp2p_identity

    path = tmp_path / "peer.id"
    assert create_libp2p_identity(str(path))
    assert mode(path) == 0o600
    peer_id = PeerID.from_identity(path.read_bytes())
    assert not create_libp2p_identity(str(path)), "an existing identity is kept"
    assert PeerID.from_identity(path.read_bytes()) == peer_id


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_peer_started_with_a_new_identity_uses_the_0600_file_it_wrote(tmp_path, umask_022):
    from hivemind.p2p import PeerID

    from peer.network.swarm import NetworkConfig, join

    identity = tmp_path / "ids" / "peer.id"
    with join(NetworkConfig.loopback(identity_path=str(identity)), "run-a") as swarm:
        assert mode(identity) == 0o600 and mode(f"{identity}.rsa") == 0o600 and mode(identity.parent) == 0o700
        assert swarm.peer_id == PeerID.from_identity(identity.read_bytes())
