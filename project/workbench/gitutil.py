"""git and GNU patch, run with every setting that could change their output pinned."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import WorkbenchError

# A fixed identity and date make every materialized commit, and so every
# exported patch, byte-identical from one run to the next.
IDENTITY = {
    "GIT_AUTHOR_NAME": "vLLM KV lifecycle stack",
    "GIT_AUTHOR_EMAIL": "kvlc-stack@users.noreply.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "vLLM KV lifecycle stack",
    "GIT_COMMITTER_EMAIL": "kvlc-stack@users.noreply.invalid",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000",
}
PINNED_CONFIG = (
    "core.attributesFile=/dev/null",
    "core.quotePath=true",
    "core.autocrlf=false",
    "core.safecrlf=false",
    "commit.gpgSign=false",
    "diff.renames=false",
    "diff.algorithm=myers",
    "diff.noprefix=false",
    "diff.mnemonicPrefix=false",
    "diff.context=3",
    "diff.interHunkContext=0",
    "diff.suppressBlankEmpty=false",
    "format.signature=",
    "gc.auto=0",
)
ENTRY_TRAILER = "Kvlc-Entry"
BASE_REF = "refs/kvlc/base"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(IDENTITY)
    env["LC_ALL"] = "C"
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    env["GIT_CONFIG_GLOBAL"] = os.devnull
    return env


def git_status(
    repo: Path, *args: str, input: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """Run git in ``repo`` with the pinned settings; the caller reads the status."""
    cmd = ["git"]
    for setting in PINNED_CONFIG:
        cmd += ["-c", setting]
    cmd += list(args)
    return subprocess.run(
        cmd, cwd=repo, env=_env(), input=input, capture_output=True, check=False
    )


def git(repo: Path, *args: str, input: bytes | None = None) -> bytes:
    """Run git in ``repo`` and return stdout; a failure raises WorkbenchError."""
    proc = git_status(repo, *args, input=input)
    if proc.returncode != 0:
        raise WorkbenchError(
            f"git {' '.join(args)} failed in {repo}:\n"
            + proc.stderr.decode(errors="replace").strip()
        )
    return proc.stdout


def git_text(repo: Path, *args: str) -> str:
    return git(repo, *args).decode()


def commit_tree(repo: Path, message: str, parent: str | None) -> str:
    """Commit the index verbatim (no message cleanup) on top of ``parent``."""
    tree = git_text(repo, "write-tree").strip()
    args = ["commit-tree", tree]
    if parent:
        args += ["-p", parent]
    return git(repo, *args, input=message.encode()).decode().strip()


def with_trailer(message: str, entry: str) -> str:
    return f"{message.rstrip()}\n\n{ENTRY_TRAILER}: {entry}\n"


_TRAILER = re.compile(rf"\n\n{ENTRY_TRAILER}: (\S+)\n*$")


def split_trailer(message: str) -> tuple[str, str | None]:
    """Undo ``with_trailer``: the entry message and the entry name, if any."""
    m = _TRAILER.search(message)
    if not m:
        return message, None
    return message[: m.start()] + "\n", m.group(1)


@dataclass(frozen=True)
class PatchResult:
    ok: bool
    output: str

    @property
    def offsets(self) -> list[str]:
        return re.findall(r"(?m)^Hunk #\d+ succeeded at \d+ \(offset.*$", self.output)

    @property
    def fuzzed(self) -> list[str]:
        return re.findall(r"(?m)^Hunk #\d+ succeeded at \d+ with fuzz.*$", self.output)

    def failed_hunks(self) -> list[tuple[str, int]]:
        """(file, hunk number) of each failed hunk, from GNU patch's report."""
        failed = []
        current = ""
        for line in self.output.splitlines():
            if m := re.match(r"(?:checking|patching) file (.+)$", line):
                current = m.group(1).strip("'")
            elif m := re.match(r"Hunk #(\d+) FAILED", line):
                failed.append((current, int(m.group(1))))
        return failed


def run_patch(
    tree: Path, patch: str, *, dry_run: bool, fuzz: int = 0, reverse: bool = False
) -> PatchResult:
    """Apply a -p1 patch to ``tree`` with GNU patch.

    GNU patch, not ``git apply``: the CPU build applies to an unpacked wheel
    that may sit inside another git work tree, where ``git apply`` silently
    skips paths. Using one tool everywhere keeps materialize and build in step.
    """
    cmd = [
        "patch",
        "-p1",
        "--batch",
        "--forward",
        "--no-backup-if-mismatch",
        "--reject-file=-",
        f"--fuzz={fuzz}",
    ]
    if dry_run:
        cmd.append("--dry-run")
    if reverse:
        cmd.append("--reverse")
    proc = subprocess.run(
        cmd,
        cwd=tree,
        input=patch.encode(),
        capture_output=True,
        check=False,
        env={**os.environ, "LC_ALL": "C"},
    )
    output = (proc.stdout + proc.stderr).decode(errors="replace")
    return PatchResult(proc.returncode == 0, output)
