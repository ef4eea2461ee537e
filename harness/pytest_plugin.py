"""pytest plugin (entry point ``k3_harness``): one test per criterion of a tier, judged on a real run.

    pytest tests/cluster --k3-run RUN --k3-tier full [--k3-profile gb300] [--k3-summary summary.md] \\
        [--junitxml results.xml]

A test that asks for the ``k3_criterion`` fixture is parametrized with the tier's criteria (ids = criterion
ids); ``k3_result`` is that criterion's verdict on the run, read once per session. Without ``--k3-run`` (or
``K3_CLUSTER_RUN``) those tests skip. ``--k3-summary`` writes the Markdown table of every verdict at the end
of the session (for CI step summaries); JUnit XML is pytest's own ``--junitxml``.

Loaded by every pytest run of the project, so importing it costs nothing beyond pytest: the harness is
imported only when a test asks for a criterion.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

RUN_ENV = "K3_CLUSTER_RUN"
_RESULTS = pytest.StashKey[list]()  # verdicts of the session's criterion tests, for the summary
_RUN = pytest.StashKey[object]()  # the run they were judged on


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("k3-harness", "judge a Kimi-K3 run with the harness's criteria")
    group.addoption("--k3-run", default=None, metavar="RUN",
                    help=f"run directory / recipe log / TensorBoard dir / W&B offline run to judge (or ${RUN_ENV})")
    group.addoption("--k3-tier", default="full", metavar="T", help="tier: smoke, gpu, 4layer, full or a spec .toml")
    group.addoption("--k3-profile", default=None, metavar="P", help="hardware profile (full: gb300)")
    group.addoption("--k3-summary", default=None, metavar="PATH",
                    help="write a Markdown summary of the verdicts here (e.g. $GITHUB_STEP_SUMMARY)")


def _run_path(config: pytest.Config) -> str | None:
    return config.getoption("--k3-run") or os.environ.get(RUN_ENV) or None


def _tier(config: pytest.Config) -> Any:
    cached = getattr(config, "_k3_tier", None)
    if cached is None:
        from harness.tier import load_tier

        cached = load_tier(config.getoption("--k3-tier"))
        config._k3_tier = cached  # type: ignore[attr-defined]
    return cached


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "k3_criterion" not in metafunc.fixturenames:
        return
    tier = _tier(metafunc.config)
    criteria = tier.active(metafunc.config.getoption("--k3-profile"))
    metafunc.parametrize("k3_criterion", criteria, ids=[c.id for c in criteria])


@pytest.fixture(scope="session")
def k3_run(request: pytest.FixtureRequest) -> Any:
    """The run named by ``--k3-run``, read once; skips the test when none is configured."""
    path = _run_path(request.config)
    if path is None:
        pytest.skip(f"no run to judge (--k3-run RUN or ${RUN_ENV})")
    from harness.readers import read_run

    run = read_run(path)
    request.config.stash[_RUN] = run
    return run


@pytest.fixture
def k3_result(k3_criterion: Any, k3_run: Any, request: pytest.FixtureRequest) -> Any:
    """The verdict of this test's criterion on the run (recorded for the Markdown summary)."""
    from harness.criteria import evaluate

    result = evaluate(k3_criterion, k3_run)
    request.config.stash.setdefault(_RESULTS, []).append(result)
    return result


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--k3-summary", default=None)
    results = session.config.stash.get(_RESULTS, [])
    if not path or not results:
        return
    from harness.report import markdown_summary

    run = session.config.stash[_RUN]
    profile = session.config.getoption("--k3-profile")
    with open(path, "a", encoding="utf-8") as f:
        f.write(markdown_summary(results, run, _tier(session.config), profile) + "\n")
