"""Acceptance: every criterion of the chosen tier, judged on a real run (skipped unless one is configured).

    pytest tests/cluster --k3-run runs/acceptance-full --k3-tier full --k3-profile gb300 \\
        --k3-summary summary.md --junitxml acceptance.xml

The harness's pytest plugin makes one test per criterion (ids = criterion ids, see `k3-harness criteria`).
A criterion passes only with PASS: PENDING (the run is not far enough) and MISSING (the data is not there)
fail an acceptance run like FAIL does.
"""

from __future__ import annotations

import pytest

from harness.criteria import Status

pytestmark = pytest.mark.cluster


def test_criterion(k3_result):
    detail = f"{k3_result.status}: {k3_result.summary}"
    if k3_result.where:
        detail += f" [{k3_result.where}]"
    assert k3_result.status is Status.PASS, f"{detail}\n  recipe: {k3_result.criterion.doc}"
