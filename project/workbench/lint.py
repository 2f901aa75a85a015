"""Upstream's own pre-commit hooks, run on the files the stack touches.

The hooks come from the pristine ``.pre-commit-config.yaml`` of the release,
with their pinned versions and arguments. Hooks that live in other git
repositories cannot be cloned here (package registries only), so the two we
need from them, ruff and ruff-format, are rewritten as local hooks installing
the same ruff version from the registry, and run without ``--fix`` so a check
never edits the tree. Hooks that need tools outside the registries (typos,
markdownlint, shellcheck, clang-format, ...) are not run; the list of hooks
run is printed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from workbench import upstream
from workbench.errors import WorkbenchError
from workbench.tools import tools_python

HOOKS = (
    "ruff-check",
    "ruff-format",
    "mypy",
    "check-spdx-header",
    "check-root-lazy-imports",
    "check-forbidden-imports",
    "check-torch-cuda-call",
    "check-boolean-context-manager",
)

# Runs under the lint environment's python, which has PyYAML (a pre-commit
# dependency): argv = upstream config, derived config, hook ids.
_DERIVE = r"""
import re, sys, yaml
src, dest, *wanted = sys.argv[1:]
config = yaml.safe_load(open(src))
hooks = []
for repo in config["repos"]:
    for hook in repo["hooks"]:
        if hook["id"] not in wanted:
            continue
        if repo["repo"] == "local":
            hooks.append(hook)
            continue
        assert "ruff" in repo["repo"], repo["repo"]
        version = repo["rev"].lstrip("v")
        entry = {"ruff-check": "ruff check --output-format concise",
                 "ruff-format": "ruff format --check --diff"}[hook["id"]]
        hooks.append({"id": hook["id"], "name": hook["id"], "entry": entry,
                      "language": "python", "types_or": ["python", "pyi"],
                      "require_serial": True,
                      "additional_dependencies": [f"ruff=={version}"]})
missing = set(wanted) - {h["id"] for h in hooks}
if missing:
    sys.exit(f"upstream's .pre-commit-config.yaml has no hooks {sorted(missing)}")
derived = {"repos": [{"repo": "local", "hooks": hooks}]}
if "exclude" in config:
    derived["exclude"] = config["exclude"]
yaml.safe_dump(derived, open(dest, "w"), sort_keys=False)
"""


def own_inodes(tree: Path, files: list[str]) -> None:
    """Give each of ``files`` (relative to ``tree``) an inode of its own.

    A hook may fix a file in place (check-spdx-header rewrites a header), and
    ``tree`` may be hard-linked to the pristine release (``check``'s is): the
    fix must not reach the release's copy.
    """
    for name in files:
        path = tree / name
        if path.stat().st_nlink > 1:
            own = path.with_name(f".{path.name}.own")
            shutil.copy2(path, own)
            own.replace(path)


def run_upstream_hooks(tree: Path, files: list[str]) -> list[str]:
    """Run the hooks on ``files`` (relative to ``tree``); return failures."""
    files = [f for f in files if (tree / f).is_file()]
    if not files:
        print("lint: no files to check")
        return []
    own_inodes(tree, files)
    python = tools_python()
    derived = tree.parent / f".{tree.name}-pre-commit.yaml"
    subprocess.run(
        [
            str(python),
            "-c",
            _DERIVE,
            str(tree / ".pre-commit-config.yaml"),
            str(derived),
            *HOOKS,
        ],
        check=True,
    )
    print(f"lint: upstream hooks {', '.join(HOOKS)} on {len(files)} files")
    env = {**os.environ, "MYPY_CACHE_DIR": str(upstream.cache_dir() / "mypy-cache")}
    proc = subprocess.run(
        [
            str(python),
            "-m",
            "pre_commit",
            "run",
            "--config",
            str(derived),
            "--color",
            "never",
            "--files",
            *files,
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        if "Failed" not in proc.stdout:
            raise WorkbenchError(
                f"pre-commit could not run:\n{proc.stdout}{proc.stderr}"
            )
        return ["upstream pre-commit hooks failed (output above)"]
    return []
