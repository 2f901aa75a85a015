"""Release test: the stack on the newest release, tested on CPU without a wheel.

No CPU wheel of vLLM ``NEXT_RELEASE`` exists, but its sdist installs as pure
Python (``VLLM_TARGET_DEVICE=empty``: no compiled extensions), which runs
upstream's scheduler and KV connector unit tests here. ``./wb release-test``:

1. makes the environment once per machine (a venv in the workbench cache):
   CPU torch, the release's build requirements, the pristine sdist installed
   as pure Python, ``project/requirements-test.txt``. The release pins
   ``torch==2.14.0``, which has no CPU build on the index; torch is held at
   ``TORCH`` instead (a constraint), which its pure-Python code imports;
2. derives the stack onto the release (``derive.py``, ``build/vllm-<release>``)
   unless that tree holds edits not yet refreshed, which are then tested as
   they are, and installs it over the pristine release (``+kvlc``);
3. runs upstream's pre-commit hooks of the release (ruff, mypy, ...) on the
   files the stack touches, as ``wb check`` does on the pinned release, then
   imports every module the stack changes, Model Runner V2's and
   ``gpu_model_runner.py`` included: on CPU without compiled ops they can be
   import-checked only, not run;
4. runs ``SELECTION`` (upstream's tests of what the stack touches) and the
   stack's own tests, judged by ``wb regress`` against
   ``data/baseline-vllm-<release>-cpu.txt``: the tests that pass on the
   unpatched release here. ``--record`` reinstalls the pristine release and
   records that baseline instead.

``--fast`` (CI's) runs ``FAST_SELECTION`` instead of ``SELECTION``, with
the stack's own tests and the upstream tests it edits as always.
``--prefixes`` builds and tests every prefix of the stack on the release,
as ``wb prefix-check`` does on the pinned one (``build/prefix-<release>``):
each entry on the entries below it alone, with its own tests.

The stack's end-to-end tests (a served model) need the compiled CPU build and
run on the pinned release only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import venv
from collections.abc import Sequence
from pathlib import Path

from workbench import derive, devenv, lint, prefixes, regress, stack, upstream
from workbench.build import LOCAL_LABEL
from workbench.check import touched_files
from workbench.errors import WorkbenchError
from workbench.materialize import unrefreshed_work

RELEASE = upstream.NEXT_RELEASE
TORCH = "torch==2.13.0+cpu"
# What the release's pyproject.toml [build-system] needs to build without
# isolation (cmake and ninja are for the compiled extensions it skips).
BUILD_REQUIREMENTS = (
    "packaging>=24.2",
    "setuptools>=77.0.3,<81.0.0",
    "setuptools-scm>=8.0",
    "setuptools-rust>=1.9.0",
    "wheel",
    "jinja2",
    "numpy",
)
BASELINE = (
    Path(__file__).parent / "data" / f"baseline-vllm-{upstream.NEXT_RELEASE}-cpu.txt"
)
# Upstream's tests of the code the stack changes: the scheduler, the
# connectors it migrates (MultiConnector, LMCache, SimpleCPUOffload), HMA
# configuration, and the connector/scheduler interplay it touches.
SELECTION = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/kv_connector/unit/test_multi_connector.py",
    "tests/v1/kv_connector/unit/test_lmcache_connector.py",
    "tests/v1/kv_connector/unit/test_hma_auto_config.py",
    "tests/v1/kv_connector/unit/test_config.py",
    "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py",
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "tests/v1/kv_connector/unit/test_error_propagation.py",
    "tests/v1/simple_kv_offload",
)
# CI's subset (--fast): with the stack's own tests and the upstream tests it
# edits (which --stack-tree adds), upstream's tests of the connector every
# entry changes and of the deferred loads only this release has, which the
# lifecycle's delta changes; SELECTION's others, the scheduler's above all,
# run on the pinned release in CI and here in full.
FAST_SELECTION = (
    "tests/v1/kv_connector/unit/test_multi_connector.py",
    "tests/v1/core/test_deferred_block_free.py",
)
# A module the stack changes imports on the release (checked before the tests).
_IMPORT_CHECK = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(f"imported {len(sys.argv) - 1} modules the stack changes")
"""


def env_dir() -> Path:
    return upstream.cache_dir() / f"venv-vllm-{RELEASE}"


def _build_env(release_version: str) -> dict[str, str]:
    # empty: no compiled extensions; the version is what regress reads to
    # tell the stack's build from the pristine one.
    return {"VLLM_TARGET_DEVICE": "empty", "VLLM_VERSION_OVERRIDE": release_version}


def _env_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for part in (upstream.NEXT_SDIST.sha256, TORCH, *BUILD_REQUIREMENTS):
        digest.update(part.encode() + b"\0")
    digest.update((root / devenv.TEST_REQUIREMENTS).read_bytes())
    return digest.hexdigest()


def env_ready(root: Path) -> bool:
    """Whether the release's test environment is made for today's inputs."""
    marker = env_dir() / "kvlc-installed"
    return marker.is_file() and marker.read_text() == _env_digest(root)


def ensure_env(root: Path) -> Path:
    """The release's test environment (made once per machine); its python."""
    where = env_dir()
    python = where / "bin" / "python"
    marker = where / "kvlc-installed"
    if env_ready(root):
        print(f"{where}: vLLM {RELEASE} test environment is up to date")
        return python
    print(f"creating {where}")
    venv.create(where, with_pip=True, clear=True)
    log = where / "pip-install.log"
    constraint = where / "torch-constraint.txt"
    constraint.write_text(TORCH + "\n")
    pin = ["-c", str(constraint)]
    devenv.pip_install(
        python,
        [*pin, TORCH, *BUILD_REQUIREMENTS],
        f"installing CPU torch ({TORCH}, not the release's pin) and the "
        "release's build requirements",
        log,
    )
    devenv.pip_install(
        python,
        [*pin, "--no-build-isolation", str(upstream.fetch(upstream.NEXT_SDIST))]
        + ["-r", str(root / devenv.TEST_REQUIREMENTS)],
        f"installing vLLM {RELEASE} from its sdist as pure Python, and the "
        "test requirements",
        log,
        env=_build_env(RELEASE),
    )
    devenv.share_files(where, root)
    marker.write_text(_env_digest(root))
    return python


def install_tree(
    python: Path, tree: Path, version: str, target: Path | None = None
) -> None:
    """Install ``tree`` (a vLLM source tree) over the environment's vLLM, or
    into ``target`` (a site-packages directory) alone."""
    # pip builds a directory in place, and the build rewrites vllm/_version.py
    # and the egg-info: a copy keeps the tree (a git work tree) as it was.
    with tempfile.TemporaryDirectory(prefix="kvlc-release-") as tmp:
        source = Path(tmp) / tree.name
        shutil.copytree(tree, source, ignore=shutil.ignore_patterns(".git"))
        where = ["--force-reinstall"] if target is None else ["--target", str(target)]
        devenv.pip_install(
            python,
            ["--no-deps", "--no-build-isolation", *where, str(source)],
            f"installing {tree} as vLLM {version} (pure Python)",
            env_dir() / "pip-install.log",
            env=_build_env(version),
        )


def changed_modules(root: Path) -> list[str]:
    """The vllm modules the stack adds or changes, as import names."""
    names = (prefixes.module_name(p) for p in touched_files(stack.load(root)))
    return sorted(name for name in names if name)


def import_check(python: Path, modules: Sequence[str]) -> None:
    """Import each module under ``python`` from a neutral directory."""
    checked = subprocess.run(
        [str(python), "-c", _IMPORT_CHECK, *modules],
        cwd=env_dir(),
        capture_output=True,
        text=True,
        check=False,
    )
    if checked.returncode != 0:
        raise WorkbenchError(
            f"a module the stack changes does not import on vLLM {RELEASE}:\n"
            + checked.stderr[-3000:]
        )
    print(checked.stdout.strip())


def prefix_builder(python: Path) -> prefixes.Builder:
    """Install a prefix's derived tree into its own environment over
    ``python``'s packages (as ``prefixes.ensure_prefix_env`` does on the
    pinned release)."""

    def build(prefix: stack.Stack, where: Path) -> Path:
        version = f"{RELEASE}+{LOCAL_LABEL}"
        return prefixes.overlay_env(
            where / "venv",
            python,
            lambda target: install_tree(python, where / "tree", version, target),
        )

    return build


def check_prefixes(root: Path, python: Path) -> int:
    """Every prefix of the stack derived onto the release, installed, and its
    top entry's tests and upstream's tests of what it touches run."""
    results = prefixes.check_prefixes(
        stack.load(root),
        root,
        scope=SELECTION,
        builder=prefix_builder(python),
        baseline=regress.read_baseline(BASELINE),
        make_tree=lambda prefix, tree: derive.derive(prefix, tree, force=True),
        prefix_dir=Path("build") / f"prefix-{RELEASE}",
    )
    return prefixes.report(results)


def main(root: Path, argv: Sequence[str]) -> int:
    """``wb release-test [--record | --prefixes] [regress options] [-- pytest
    args]``. ``--prefixes``: each prefix of the stack, as ``wb prefix-check``
    does on the pinned release."""
    argv = list(argv)
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        print("Options other than --record go to ./wb regress (./wb regress --help).")
        return 0
    options, extra = argv, []
    if "--" in argv:
        cut = argv.index("--")
        options, extra = argv[:cut], argv[cut:]
    python = ensure_env(root)
    # A pure-Python vLLM detects no platform; the tests run on the CPU one.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    fast = "--fast" in options
    options = [o for o in options if o != "--fast"]
    common = ["--python", str(python), "--baseline", str(BASELINE), *options]
    selection = [*(FAST_SELECTION if fast else SELECTION), *extra]
    if "--prefixes" in options:
        return check_prefixes(root, python)
    if "--record" in options:
        pristine = upstream.next_pristine_tree()
        install_tree(python, pristine, RELEASE)
        made_by = (
            "./wb release-test --record (./wb regress --record on the "
            "release-test environment, the selection above)"
        )
        return regress.main(
            [*common, "--tests-from", str(pristine), "--made-by", made_by, *selection]
        )
    tree = derive.default_tree(root)
    if tree.exists() and unrefreshed_work(tree):
        print(f"testing {tree} as it is: it holds edits not yet refreshed")
    else:
        derive.derive(stack.load(root), tree, force=True)
    if lint.run_upstream_hooks(tree, touched_files(stack.load(root))):
        raise WorkbenchError(
            f"upstream's hooks fail on the stack on vLLM {RELEASE} (output "
            f"above): fix the entry in {tree}, then ./wb derive --refresh"
        )
    install_tree(python, tree, f"{RELEASE}+{LOCAL_LABEL}")
    import_check(python, changed_modules(root))
    return regress.main([*common, "--stack-tree", str(tree), *selection])
