"""Megatron-style layouts (TP 8 + sequence parallel, ZeRO 1, micro batch 1, compiled, bf16
gradient reduction) on H100s: the estimate of what the backend runs, row by row from
tools/published_runs.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import published_runs as runs  # noqa: E402

PIPELINED = [row for row in runs.MEGATRON_STYLE if row[3] > 1]


@pytest.mark.parametrize("row", runs.MEGATRON_STYLE, ids=lambda r: f"{r[0]}-pp{r[3]}")
def test_with_async_tp_and_megatrons_interleaving_every_row_reaches_40_percent_mfu(row):
    name, dims, t, p, world, batch = row
    est = runs.megatron_style(name, dims, t, p, world, batch, async_tp=True, virtual=runs.megatron_virtual(dims[2], p))
    assert est.fits
    assert est.mfu >= 0.40, {k: round(v, 3) for k, v in est.terms.items()}


@pytest.mark.parametrize("row", PIPELINED, ids=lambda r: f"{r[0]}-pp{r[3]}")
def test_the_interleaved_schedule_divides_the_bubble_by_its_virtual_stages(row):
    name, dims, t, p, world, batch = row
    virtual = runs.megatron_virtual(dims[2], p)
    plain = runs.megatron_style(name, dims, t, p, world, batch, async_tp=True)
    interleaved = runs.megatron_style(name, dims, t, p, world, batch, async_tp=True, virtual=virtual)
    assert virtual > 1 and (dims[2] // p) % virtual == 0
    assert interleaved.layout.pp_virtual_stages == virtual
    assert interleaved.terms["bubble"] == pytest.approx(plain.terms["bubble"] / virtual, rel=0.02)
