"""What a run's closing line says when its measured step disagrees with the estimate so much
that the hardware profile must be wrong (no torch: the trainer calls it)."""

from __future__ import annotations

import os

from llmforge.hardware import UNCACHED_ENV

#: A measured step outside these multiples of the estimate (or an MFU above 100%) means the profile is off.
LOW, HIGH = 0.5, 2.0


def profile_warning(*, ratio: float, mfu: float, accelerator: str, source: str, calibration: dict) -> str:
    """``''``, or the clause a closing line ends with: the profile looks wrong, and how to measure it again.

    ``ratio`` is measured / estimated step time, ``mfu`` the measured MFU against the profile's
    peak, ``source`` the profile's file and ``calibration`` its provenance."""
    if LOW <= ratio <= HIGH and mfu <= 1.0:
        return ""
    why = f"MFU {mfu:.0%} passes 100%" if mfu > 1.0 else f"the step took {ratio:.2f}x the estimate"
    if calibration.get("trusted") is False:
        why += ", and the profile was measured on a busy machine"
    if source and source == os.environ.get(UNCACHED_ENV):
        source = "measured by this run, not cached"
    target = "" if accelerator == "cpu" else f" cluster.accelerator={accelerator}"
    if accelerator.endswith((".yaml", ".yml")):
        target += f" --out {accelerator}"
    again = " again" if calibration else ""
    return (
        f"; the hardware profile looks wrong ({why}; {source}): measure this machine{again} with "
        f"`llmforge calibrate{target}` while nothing else runs on it (unless other work slowed this run itself)"
    )
