"""Where Load may read from: only inside the operator's model root, after resolving symlinks, so
neither `..` nor a link inside the folder can reach other files."""

from __future__ import annotations

import os
from pathlib import Path

from shardlm.errors import (
    FailedPreconditionError,
    FieldViolation,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)

from shardlm_server.gateway.details import clip

MODEL_FILE_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json",
                       "tokenizer_config.json", "special_tokens_map.json", "chat_template.json",
                       "chat_template.jinja", "*.safetensors", "model.safetensors.index.json",
                       "*.gguf")


def _shown(model_path: str) -> str:
    return clip(model_path, 200)


def _denied(model_path: str, why: str) -> PermissionDeniedError:
    return PermissionDeniedError(f"model_path '{_shown(model_path)}' is not allowed: {why}",
                                 reason="PATH_NOT_ALLOWED",
                                 metadata={"model_path": _shown(model_path)})


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_model_path(model_path: str, root: str | None) -> str:
    """The resolved checkpoint to load (a folder, or a .gguf file), or a PERMISSION_DENIED /
    NOT_FOUND / FAILED_PRECONDITION error."""
    try:
        return _check(model_path, root)
    except OSError as exc:  # e.g. a name too long for the file system
        raise InvalidArgumentError(f"model_path is not a usable path ({exc.strerror})",
                                   reason="INVALID_FIELD", metadata={"field": "model_path"},
                                   field_violations=[FieldViolation("model_path",
                                                                    "not a usable path")]) from None


def _check(model_path: str, root: str | None) -> str:
    if "\x00" in model_path:
        raise _denied(model_path, "contains a NUL byte")
    folder = Path(model_path)
    if root is not None:
        root_path = Path(root).resolve()
        if not folder.is_absolute():
            folder = root_path / folder
        resolved = Path(os.path.realpath(folder))
        if not _inside(resolved, root_path):
            raise _denied(model_path, "outside the model root")
        if resolved.is_dir():
            for pattern in MODEL_FILE_PATTERNS:
                for file in resolved.glob(pattern):
                    if not _inside(Path(os.path.realpath(file)), root_path):
                        raise _denied(model_path, f"{file.name} links outside the model root")
        folder = resolved
    if not folder.exists():
        raise NotFoundError(f"model_path '{_shown(model_path)}' does not exist",
                            reason="CHECKPOINT_INVALID", metadata={"model_path": _shown(model_path)},
                            resource=("shardlm.model", _shown(model_path)))
    if folder.is_file() and folder.suffix.lower() == ".gguf":
        return str(folder)
    if not folder.is_dir():
        raise FailedPreconditionError(f"model_path '{_shown(model_path)}' is neither a checkpoint "
                                      "folder nor a .gguf file",
                                      reason="CHECKPOINT_INVALID",
                                      metadata={"model_path": _shown(model_path)})
    return str(folder)
