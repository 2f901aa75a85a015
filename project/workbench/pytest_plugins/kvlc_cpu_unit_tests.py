"""Mark every collected test ``skip_global_cleanup`` (loaded with ``-p``).

vLLM's ``tests/conftest.py`` cleans up after each test unless it carries that
marker, which upstream gives its CPU-only unit tests: the cleanup's
``gc.collect()`` walks every object of a process that imported torch and vLLM,
about 0.8 s a test on 2 cores, more than most of these tests take to run. On a
machine without an accelerator every test ``wb regress`` runs is such a test
(the selection's offloading-connector config and scheduler-context files: 472 s
with the cleanup, 227 s without, both releases' selections passing as before).
A test that fails for state an earlier one left shows as a regression against
the baseline.
"""

from typing import Any


def pytest_collection_modifyitems(items: list[Any]) -> None:
    # Items are pytest.Item; pytest is the tests' dependency, not the
    # workbench's, so it is not imported here.
    for item in items:
        item.add_marker("skip_global_cleanup")
