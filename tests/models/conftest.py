"""Fixtures the model families' tests share."""

from __future__ import annotations

import pytest

from tests.helpers import hf_reference

QWEN3_MOE = "transformers.models.qwen3_moe.modeling_qwen3_moe"


@pytest.fixture
def float64_qwen(monkeypatch):
    """transformers' Qwen3-MoE module computes in float64 too under ``hf_reference.float64_transformers``."""
    monkeypatch.setattr(hf_reference, "MODULES", hf_reference.MODULES + (QWEN3_MOE,))
