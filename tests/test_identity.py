import stat
from pathlib import Path

import pytest

from murmur.node.cli import main
from murmur.node.net.identity import KEY_FILE, IdentityError, load_or_create_identity, peer_id_of


def test_identity_is_created_private_and_stable(tmp_path: Path) -> None:
    first = peer_id_of(load_or_create_identity(tmp_path))
    assert stat.S_IMODE((tmp_path / KEY_FILE).stat().st_mode) == 0o600
    assert peer_id_of(load_or_create_identity(tmp_path)) == first
    assert first.startswith("12D3KooW")  # an Ed25519 peer ID


def test_corrupt_key_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / KEY_FILE).write_bytes(b"short")
    with pytest.raises(IdentityError, match="expected a 32-byte Ed25519 seed, found 5 bytes"):
        load_or_create_identity(tmp_path)


def test_murmur_id_prints_the_peer_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["id", "--data-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == peer_id_of(load_or_create_identity(tmp_path))
