"""Count what scheduler steps execute: a load-independent cost comparison.

Runs the workload of ``scheduler_step.py`` (same schedulers, connectors and
requests), untraced for ``--warmup`` steps, then traces ``schedule()`` +
``update_from_output()`` for ``--steps`` steps and counts every Python
bytecode executed and every function called (Python functions by file under
``vllm/`` and qualified name, C functions by name). Counts do not depend on
the machine's load, so the patched and the unpatched build can be compared
on a busy machine where timings cannot.

Run with the python of each build; prints one JSON object
``{"vllm": version, "results": {"<connector>/<n>": {"opcodes": int,
"calls": {name: count}}}}``. ``--compare A.json B.json`` prints, per
workload, the opcode counts, their ratio and every call count that differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any


def _where(filename: str) -> str:
    # The same function in two installs: keep the path from the package on.
    marker = "/vllm/"
    i = filename.rfind(marker)
    return filename[i + 1 :] if i >= 0 else Path(filename).name


class StepTracer:
    def __init__(self) -> None:
        self.opcodes = 0
        self.calls: Counter[str] = Counter()

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            self.opcodes += 1
        return self._trace

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            self.calls[f"{_where(code.co_filename)}:{code.co_qualname}"] += 1
        elif event == "c_call":
            self.calls[f"C:{getattr(arg, '__qualname__', repr(arg))}"] += 1

    def __enter__(self) -> StepTracer:
        sys.setprofile(self._profile)
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)
        sys.setprofile(None)


def measure(model_dir: str, connector: str, n: int, steps: int, warmup: int):
    import scheduler_step as ss

    scheduler = ss.make_scheduler(model_dir, n, ss.CONNECTORS[connector])
    workload = ss.Workload()
    for _ in range(n):
        scheduler.add_request(workload.request())
    tracer = StepTracer()
    for step in range(warmup + steps):
        traced = step >= warmup
        if traced:
            tracer.__enter__()
        so = scheduler.schedule()
        if traced:
            tracer.__exit__()
        output = ss.runner_output(scheduler, so)
        if traced:
            tracer.__enter__()
        scheduler.update_from_output(so, output)
        if traced:
            tracer.__exit__()
        for _ in range(n - len(scheduler.requests)):
            scheduler.add_request(workload.request())
    # The tracer's own frames (__enter__/__exit__) are the same in every run.
    return {"opcodes": tracer.opcodes, "calls": dict(tracer.calls)}


def compare(paths: list[str]) -> None:
    a, b = (json.loads(Path(p).read_text()) for p in paths)
    print(f"A = {paths[0]} ({a['vllm']}), B = {paths[1]} ({b['vllm']})")
    for key in a["results"]:
        if key not in b["results"]:
            continue
        ra, rb = a["results"][key], b["results"][key]
        ratio = rb["opcodes"] / ra["opcodes"]
        print(
            f"{key}: bytecodes A {ra['opcodes']:,} B {rb['opcodes']:,} "
            f"(B/A {ratio:.6f}, B-A {rb['opcodes'] - ra['opcodes']:+,})"
        )
        names = sorted(set(ra["calls"]) | set(rb["calls"]))
        for name in names:
            ca, cb = ra["calls"].get(name, 0), rb["calls"].get(name, 0)
            if ca != cb:
                print(f"    {name}: A {ca} B {cb}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-dir")
    p.add_argument("--sizes", default="512,4096")
    p.add_argument("--connectors", default="none,legacy,multi")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--compare", nargs=2, metavar="JSON")
    args = p.parse_args()
    if args.compare:
        compare(args.compare)
        return
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here)]
    import vllm

    results = {}
    for n in (int(s) for s in args.sizes.split(",")):
        for connector in args.connectors.split(","):
            results[f"{connector}/{n}"] = measure(
                args.model_dir, connector, n, args.steps, args.warmup
            )
    print(json.dumps({"vllm": vllm.__version__, "results": results}))


if __name__ == "__main__":
    main()
