"""Load's model_path may name a GGUF file as well as a checkpoint folder, within the same rules."""

from __future__ import annotations

import pytest
from shardlm.errors import FailedPreconditionError, PermissionDeniedError

from shardlm_server.gateway.api.paths import check_model_path


def test_a_gguf_file_inside_the_root_is_accepted(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert check_model_path("m.gguf", str(tmp_path)) == str((tmp_path / "m.gguf").resolve())
    assert check_model_path(str(tmp_path / "m.gguf"), None) == str(tmp_path / "m.gguf")


def test_another_file_is_neither_folder_nor_gguf(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FailedPreconditionError, match="neither a checkpoint folder nor a .gguf"):
        check_model_path(str(tmp_path / "notes.txt"), None)


def test_a_gguf_link_out_of_the_root_is_denied(tmp_path):
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(b"GGUF")
    root = tmp_path / "root"
    (root / "m").mkdir(parents=True)
    (root / "m" / "model.gguf").symlink_to(outside)
    (root / "direct.gguf").symlink_to(outside)
    with pytest.raises(PermissionDeniedError):
        check_model_path("m", str(root))
    with pytest.raises(PermissionDeniedError):
        check_model_path("direct.gguf", str(root))
