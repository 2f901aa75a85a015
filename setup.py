"""Not a setuptools project: ``pip install .`` builds the patched vLLM.

The packaging entry point is the in-tree PEP 517 backend named in
``pyproject.toml`` (``project/workbench/backend.py``). This file only answers
the old ``python setup.py ...`` habit with the command to use instead.
"""

import sys

sys.exit(
    "setup.py is not how this project builds: run `pip install .` "
    "(or `pip wheel .`, or `./wb build`) from the repository root."
)
