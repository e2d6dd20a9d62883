"""Our one-tensor-at-a-time safetensors reader against the safetensors library, which writes the files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from celeris_cli.arch import safetensors_io
from celeris_cli.arch.safetensors_io import read_tensors
from celeris_cli.errors import ModelError


def _file(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(37, 11, generator=g).to(torch.bfloat16),
        "b": torch.randn(5, generator=g, dtype=torch.float16),
        "ids": torch.arange(7, dtype=torch.int64),
        "f": torch.randn(3, 4, generator=g),
    }
    path = tmp_path / "t.safetensors"
    save_file(state, str(path))
    return path, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensors_read_in_pieces_and_cast_equal_the_librarys(tmp_path: Path, monkeypatch, dtype) -> None:  # type: ignore[no-untyped-def]
    path, _ = _file(tmp_path)
    monkeypatch.setattr(safetensors_io, "CHUNK_BYTES", 6)  # several pieces per tensor, one cut mid-row
    expected = load_file(str(path))
    got = dict(read_tensors(path, list(expected), "cpu", dtype))
    for name, t in expected.items():
        want = t.to(dtype) if t.is_floating_point() else t
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def test_a_truncated_file_is_a_model_error_naming_the_tensor(tmp_path: Path) -> None:
    path, _ = _file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(ModelError, match="truncated"):
        list(read_tensors(path, ["w", "b", "ids", "f"], "cpu", torch.float32))


@pytest.mark.parametrize(
    "entry",
    ['"x"', '{"dtype": "F32", "data_offsets": [0, 4]}', '{"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}'],
)
def test_a_damaged_header_is_a_model_error_naming_the_entry(tmp_path: Path, entry: str) -> None:
    import struct

    header = ('{"t": ' + entry + "}").encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(ModelError, match="damaged safetensors header \\(entry 't'\\)"):
        safetensors_io.read_header(path)
