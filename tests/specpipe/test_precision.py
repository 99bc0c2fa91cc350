"""specpipe/precision.py: MLX's TF32 float32 products on a GPU, noticed, and
turned off by the command unless the environment chose."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from specpipe import precision
from specpipe.cli import main


@pytest.mark.parametrize(
    ("value", "on"),
    [
        (None, True),
        ("1", True),
        ("0", False),
        (" 0 ", False),
        ("2", True),
        ("no", True),
    ],
)
def test_tf32_is_on_unless_the_variable_is_the_integer_zero(
    monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool
) -> None:
    # (MLX parses the variable as an integer; anything else keeps its default, on)
    if value is None:
        monkeypatch.delenv(precision.ENV, raising=False)
    else:
        monkeypatch.setenv(precision.ENV, value)
    assert precision.tf32_on() is on


def _model(dtype: mx.Dtype) -> nn.Module:
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 4), nn.RMSNorm(4))
    model.set_dtype(dtype)
    return model


def test_the_notice_names_tf32_for_float32_weights_on_a_gpu_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(precision.ENV, raising=False)
    monkeypatch.setattr(precision.mx, "default_device", lambda: mx.Device(mx.cpu))
    assert precision.tf32_notice(_model(mx.float32)) is None  # the CPU
    monkeypatch.setattr(precision.mx, "default_device", lambda: mx.Device(mx.gpu))
    line = precision.tf32_notice(_model(mx.float32))
    assert line is not None and "MLX_ENABLE_TF32=0" in line and "TF32" in line
    # bf16 matrices (float32 norms aside) and TF32 off: nothing to say
    bf16 = _model(mx.bfloat16)
    bf16.layers[2].weight = bf16.layers[2].weight.astype(mx.float32)
    assert precision.tf32_notice(bf16) is None
    monkeypatch.setenv(precision.ENV, "0")
    assert precision.tf32_notice(_model(mx.float32)) is None


def test_the_command_turns_tf32_off_unless_the_environment_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(precision.ENV, raising=False)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert precision.tf32_on() is False
    monkeypatch.setenv(precision.ENV, "1")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert precision.tf32_on() is True
