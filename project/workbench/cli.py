"""The workbench: the pinned vLLM release plus patches/ give the patched tree,
its wheel, the stacked PRs, the demo and the tests (see README.md)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from workbench import (
    build,
    bundle,
    check,
    conformance,
    demo,
    derive,
    devenv,
    export,
    materialize,
    prefixes,
    rebase,
    refresh,
    regress,
    release_test,
    stack,
    syspkgs,
    testrun,
    upstream,
)
from workbench.errors import WorkbenchError
from workbench.tools import BENCH_TOOLS, tools_python

ROOT = Path(__file__).resolve().parents[2]


def _stack(args: argparse.Namespace) -> stack.Stack:
    return stack.load(args.root)


def _tree(args: argparse.Namespace) -> Path:
    tree: Path = args.tree or args.root / "build" / "vllm"
    return tree


def cmd_fetch(args: argparse.Namespace) -> int:
    for name, artifact in upstream.ARTIFACTS.items():
        if name in args.what:
            print(f"{name}: {upstream.fetch(artifact)} (sha256 verified)")
    return 0


def cmd_materialize(args: argparse.Namespace) -> int:
    head = materialize.materialize(_stack(args), _tree(args), force=args.force)
    print(f"materialized {_tree(args)} (branch stack, HEAD {head[:12]})")
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    changes = refresh.refresh(_stack(args), _tree(args))
    for line in changes:
        print(line)
    print(f"refreshed from {_tree(args)}: {len(changes) or 'no'} file changes")
    return 0


def cmd_derive(args: argparse.Namespace) -> int:
    tree = args.tree or derive.default_tree(args.root)
    if args.refresh:
        changes = derive.refresh(_stack(args), tree)
        for line in changes:
            print(line)
        print(f"refreshed from {tree}: {len(changes) or 'no'} file changes")
        return 0
    head = derive.derive(_stack(args), tree, force=args.force)
    print(f"derived {tree} (vLLM {upstream.NEXT_RELEASE}, HEAD {head[:12]})")
    return 0


def cmd_release_test(args: argparse.Namespace) -> int:
    return release_test.main(args.root, args.rest)


def cmd_export(args: argparse.Namespace) -> int:
    out = args.out or args.root / "build" / "export"
    if args.next_release:
        out = args.out or args.root / "build" / f"export-{upstream.NEXT_RELEASE}"
    exported = export.export(
        _stack(args), out, signoff=args.signoff, next_release=args.next_release
    )
    for path in exported:
        print(f"exported {path}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    problems = check.check(_stack(args), run_lint=not args.no_lint)
    for problem in problems:
        print(f"FAIL: {problem}")
    print("check: " + ("failed" if problems else "all good"))
    if args.prefixes and not problems:
        return prefixes.main(_stack(args), args.root, [])
    return 1 if problems else 0


def cmd_prefix_check(args: argparse.Namespace) -> int:
    return prefixes.main(_stack(args), args.root, args.rest)


def cmd_build(args: argparse.Namespace) -> int:
    wheel = build.build(_stack(args), args.out or args.root / "dist", args.device)
    print(f"built {wheel}")
    return 0


def cmd_bundle(args: argparse.Namespace) -> int:
    out = args.out or args.root / "build" / "bundle"
    kit = bundle.make_kit(
        _stack(args),
        args.root,
        out,
        device=args.device,
        python_version=args.python_version,
        preset=0 if args.fast else 9,
    )
    print(bundle.describe(kit))
    where = out.relative_to(args.root) if out.is_relative_to(args.root) else out
    print(
        f"send the repository with {where}; from its root on the host: python3 "
        f"project/bench/gpu_ttft.py --kit {where} --out RESULTS (docs/gpu.md)"
    )
    return 0


def cmd_rebase_report(args: argparse.Namespace) -> int:
    label, drifts = rebase.rebase_report(_stack(args), args.target, args.rev)
    report = rebase.format_report(label, drifts)
    print(report)
    if args.output:
        args.output.write_text(report)
    return 0 if all(d.status == "clean" for d in drifts) else 1


def cmd_regress(args: argparse.Namespace) -> int:
    return regress.main(args.rest)


def cmd_venv(args: argparse.Namespace) -> int:
    if args.unpatched:
        python = devenv.ensure_unpatched(args.root)
        print(f"unpatched vLLM {upstream.RELEASE} installed for {python}")
    elif args.lmcache:
        python = devenv.ensure_lmcache(args.root)
        print(f"patched vLLM and {devenv.LMCACHE} installed for {python}")
    else:
        print(f"patched vLLM installed for {devenv.ensure(args.root)}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if "--gpu" in args.rest:
        return _bench_gpu(args.root, [a for a in args.rest if a != "--gpu"])
    # --ttft picks the other benchmark; the rest of the arguments go to it.
    ttft = "--ttft" in args.rest
    rest = [a for a in args.rest if a != "--ttft"]
    # Its peers' system packages before any environment is built.
    if ttft and not syspkgs.ensure(
        args.root, "./wb bench --ttft", syspkgs.for_ttft(rest)
    ):
        return 1
    python = tools_python("bench", BENCH_TOOLS)
    script = "ttft.py" if ttft else "run.py"
    return _call([str(python), str(args.root / "project" / "bench" / script), *rest])


def _bench_gpu(root: Path, rest: list[str]) -> int:
    """``./wb bench --gpu``: project/bench/gpu_ttft.py with the patched CUDA
    build in ``.venv`` (``./wb venv`` builds it where an NVIDIA GPU is)."""
    # The plan, a summary and the help read no GPU and import no vLLM.
    offline = bool({"--help", "--plan-only", "--summarize"} & set(rest))
    device, why = build.target_device()
    if device != "cuda" and not offline:
        print(
            f"./wb bench --gpu needs an NVIDIA GPU: {why}",
            file=sys.stderr,
        )
        return 1
    script = root / "project" / "bench" / "gpu_ttft.py"
    kit = root / "build" / "bundle"
    if not offline and "--kit" not in rest and (kit / bundle.MANIFEST).is_file():
        # Built for a host without a package index: .venv cannot be made there.
        print(f"using the kit in {kit} (./wb bundle)", file=sys.stderr)
        rest = ["--kit", str(kit), *rest]
    if offline or "--kit" in rest:
        return _call([sys.executable, str(script), *rest])
    return _call([str(devenv.ensure(root)), str(script), *rest])


def cmd_demo(args: argparse.Namespace) -> int:
    return demo.run(args.root, args.rest)


def cmd_conformance(args: argparse.Namespace) -> int:
    return conformance.main(args.root, make=not args.no_venv)


def cmd_test(args: argparse.Namespace) -> int:
    """What CI runs: project lint, the project's tests, upstream's tests (fast set)."""
    return testrun.run(args.root, args.rest)


def _call(
    cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> int:
    print(f"$ {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd, cwd=cwd, env=env)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wb", description=__doc__)
    p.add_argument(
        "--root", type=Path, default=ROOT, help="repository root holding patches/"
    )
    sub = p.add_subparsers(required=True, metavar="command")

    def add(
        name: str, func: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        # Pass-through commands leave --help to the tool they run.
        sp = sub.add_parser(
            name, help=help, description=help, add_help=name not in PASS_THROUGH
        )
        sp.set_defaults(func=func)
        return sp

    sp = add("fetch", cmd_fetch, "download and verify the pinned release files")
    sp.add_argument(
        "what",
        nargs="*",
        default=list(upstream.ARTIFACTS),
        choices=list(upstream.ARTIFACTS),
    )
    sp = add(
        "materialize", cmd_materialize, "build the patched tree as a git repository"
    )
    sp.add_argument("--tree", type=Path, help="default: ROOT/build/vllm")
    sp.add_argument(
        "--force", action="store_true", help="discard unrefreshed work in --tree"
    )
    sp = add(
        "refresh",
        cmd_refresh,
        "write the materialized repository's commits back into patches/",
    )
    sp.add_argument("--tree", type=Path, help="default: ROOT/build/vllm")
    sp = add(
        "venv",
        cmd_venv,
        "install the stack into .venv (pip install . + test requirements), if changed",
    )
    sp.add_argument(
        "--unpatched",
        action="store_true",
        help="instead: the release's CPU wheel in build/venv-unpatched",
    )
    sp.add_argument(
        "--lmcache",
        action="store_true",
        help="instead: the patched vLLM with the real lmcache in build/venv-lmcache",
    )
    sp = add(
        "export", cmd_export, "write the stack as deterministic stacked PR patches"
    )
    sp.add_argument("--out", type=Path, help="default: ROOT/build/export")
    sp.add_argument(
        "--signoff",
        metavar="'NAME <EMAIL>'",
        help="the person who signs off every commit (DCO Signed-off-by; "
        f"default: ${export.SIGNOFF_ENV}; required)",
    )
    sp.add_argument(
        "--next-release",
        action="store_true",
        help=f"the PRs against vLLM {upstream.NEXT_RELEASE} (./wb derive's "
        f"stack; default --out: ROOT/build/export-{upstream.NEXT_RELEASE})",
    )
    sp = add(
        "check",
        cmd_check,
        "validate the stack (apply, ownership, round trips, upstream lint)",
    )
    sp.add_argument(
        "--no-lint", action="store_true", help="skip upstream's pre-commit hooks"
    )
    sp.add_argument(
        "--prefixes",
        action="store_true",
        help="the full check: then build and test every prefix (wb prefix-check)",
    )
    add(
        "prefix-check",
        cmd_prefix_check,
        "build every prefix of the stack and run its top entry's tests and "
        "upstream's tests of what it touches (./wb prefix-check --help)",
    )
    sp = add(
        "derive",
        cmd_derive,
        f"build the stack on vLLM {upstream.NEXT_RELEASE} at "
        f"build/vllm-{upstream.NEXT_RELEASE}: git's pick of each entry plus its "
        f"patches/<entry>/on-{upstream.NEXT_RELEASE}.patch",
    )
    sp.add_argument("--tree", type=Path, help="default: build/vllm-<release>")
    sp.add_argument(
        "--force", action="store_true", help="discard edits not yet refreshed"
    )
    sp.add_argument(
        "--refresh",
        action="store_true",
        help="write each entry's on-<release>.patch back from the tree's commits",
    )
    add(
        "release-test",
        cmd_release_test,
        f"the stack on vLLM {upstream.NEXT_RELEASE}, tested on CPU: make its "
        "test environment (pure-Python install of the sdist), derive and install "
        "the stack, import-check what it changes, run upstream's tests of it and "
        "the stack's, against the recorded baseline (--record: record it)",
    )
    sp = add("build", cmd_build, "build the patched vLLM wheel")
    sp.add_argument("--out", type=Path, help="default: ROOT/dist")
    sp.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="default: VLLM_TARGET_DEVICE or what the machine has",
    )
    sp = add(
        "bundle",
        cmd_bundle,
        "build the kit a GPU host without a package index runs the stack "
        "from (the patched CUDA build for dense models on Hopper, missing "
        "dependencies, the connector) in one file of a few tens of MiB "
        "(docs/gpu.md)",
    )
    sp.add_argument("--out", type=Path, help="default: ROOT/build/bundle")
    sp.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda: the Hopper kit (default); cpu: the same kit from the CPU "
        "build, what the offline rehearsal installs",
    )
    sp.add_argument(
        "--python-version",
        default=bundle.PYTHON_VERSION,
        help="the host's Python, for compiled wheels (default: %(default)s)",
    )
    sp.add_argument(
        "--fast",
        action="store_true",
        help="compress fast (xz -0) rather than small: for tests",
    )
    sp = add(
        "rebase-report",
        cmd_rebase_report,
        "assess the stack on a newer vLLM (sdist, git repository or tree) with "
        "git's three-way merge",
    )
    sp.add_argument(
        "target", type=Path, help="a vLLM sdist, git repository, or source tree"
    )
    sp.add_argument("--rev", help="for a git repository: the revision (default HEAD)")
    sp.add_argument("--output", type=Path, help="also write the markdown report here")
    add(
        "regress",
        cmd_regress,
        "run upstream's tests against an installed build, compare to the baseline "
        "(./wb regress --help)",
    )
    add(
        "demo",
        cmd_demo,
        "install the patched vLLM and serve the demo model with a connector "
        "(extra arguments go to project/demo/serve_demo.py)",
    )
    add(
        "bench",
        cmd_bench,
        "patched vs unpatched vLLM: scheduler step, worker hook, serve; writes "
        "project/docs/benchmarks.md (./wb bench --help); with --ttft: TTFT of a "
        "repeated prompt per external KV cache, project/docs/ttft.md "
        "(./wb bench --ttft --help); with --gpu: on an NVIDIA GPU, in one call "
        "of --budget-s (330 s): TTFT of recompute, OffloadingConnector's hit, "
        "StoreConnector's first request, hot and cold hits (--plan 2: V1, CUDA "
        "graphs, load_async), the time plan printed first (--plan-only: no GPU "
        "needed), results.jsonl written as it goes (--summarize DIR) "
        "(./wb bench --gpu --help; results in project/docs/gpu.md)",
    )
    sp = add(
        "conformance",
        cmd_conformance,
        "run the conformance kit against every connector this build runs, in "
        ".venv, the unpatched vLLM and the LMCache environment (made if needed), "
        "with the servers they need; writes project/docs/conformance.md",
    )
    sp.add_argument(
        "--no-venv",
        action="store_true",
        help="use the environments as they are (one not made is reported)",
    )
    add(
        "test",
        cmd_test,
        "everything CI runs; installs the patched vLLM into .venv first "
        "(extra arguments go to pytest)",
    )
    return p


# These pass the arguments they do not know on to the tool they run.
PASS_THROUGH = {"regress", "release-test", "demo", "test", "bench", "prefix-check"}


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, rest = p.parse_known_args(argv)
    command = args.func.__name__.removeprefix("cmd_").replace("_", "-")
    if rest and command not in PASS_THROUGH:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        return int(args.func(args))
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("wb: interrupted", file=sys.stderr)
        return 130
