"""Export: the stack as stacked PRs, one ``git format-patch`` file per entry.

The output is deterministic: materialize pins identity and dates, and the
format-patch flags drop everything that changes between runs or git versions
(the commit hash in the ``From`` line, the version signature, the diffstat,
abbreviated blob ids). Every export is checked by ``git am`` onto the pristine
tree, which must reproduce the materialized tree exactly.

vLLM takes only commits with a DCO ``Signed-off-by:`` trailer, and the DCO is
a person's statement: every exported commit is authored and signed off by the
person who submits the PRs, ``--signoff "Name <email>"`` or ``KVLC_SIGNOFF``
(vLLM's DCO check matches the sign-off against the author). Export
refuses to run without one, and refuses the project's placeholder identity
(the one materialize commits with). vLLM's AGENTS.md asks AI-assisted commits
to credit the agent with a ``Co-authored-by:`` trailer, so every commit carries
``AI_CO_AUTHOR`` too. ``git interpret-trailers`` adds both to the message's own
trailer block, each once. ``./wb check``'s round trip exports without trailers
(``format_patches`` and ``am_onto_base``), so it needs no identity.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import replace
from email.utils import formataddr
from pathlib import Path

from workbench import derive, upstream
from workbench.errors import WorkbenchError
from workbench.gitutil import BASE_REF, IDENTITY, git, git_text
from workbench.materialize import build_repo
from workbench.stack import Stack

SIGNOFF_ENV = "KVLC_SIGNOFF"
# The agent that wrote the stack with its submitter (AGENTS.md, "Commit messages").
AI_CO_AUTHOR = "Claude <noreply@anthropic.com>"
_PLACEHOLDER = (IDENTITY["GIT_AUTHOR_NAME"], IDENTITY["GIT_AUTHOR_EMAIL"])
_IDENTITY = re.compile(
    r"^(?P<name>[^<>\n]*[^<>\s][^<>\n]*) <(?P<email>[^<>\s@]+@[^<>\s@]+)>$"
)
_PLACEHOLDER_FROM = f"\nFrom: {_PLACEHOLDER[0]} <{_PLACEHOLDER[1]}>\n".encode()
_HOW = (
    f"pass --signoff 'Full Name <email@host>' or set {SIGNOFF_ENV}, "
    "naming the person who submits the PRs"
)


def signoff_identity(given: str | None = None) -> str:
    """The person who signs the export off: ``given``, else ``$KVLC_SIGNOFF``.

    Raises:
        WorkbenchError: if neither is set, the identity is not
            ``Full Name <email@host>``, or it is the project's placeholder.
    """
    identity = (given or os.environ.get(SIGNOFF_ENV) or "").strip()
    if not identity:
        raise WorkbenchError(f"export needs the DCO sign-off of a real person: {_HOW}")
    match = _IDENTITY.match(identity)
    if not match:
        raise WorkbenchError(
            f"sign-off identity {identity!r} is not 'Full Name <email@host>'; {_HOW}"
        )
    if match["name"].strip() in _PLACEHOLDER or match["email"] in _PLACEHOLDER:
        raise WorkbenchError(
            f"sign-off identity {identity!r} is the project's placeholder, not a "
            f"person; {_HOW}"
        )
    return identity


def signed_off(message: str, identity: str, scratch: Path) -> str:
    """``message`` with ``Co-authored-by: AI_CO_AUTHOR`` and
    ``Signed-off-by: identity`` trailers, neither doubled."""
    signed = git(
        scratch,
        "interpret-trailers",
        "--if-exists",
        "addIfDifferent",
        "--trailer",
        f"Co-authored-by: {AI_CO_AUTHOR}",
        "--trailer",
        f"Signed-off-by: {identity}",
        input=message.encode(),
    ).decode()
    return signed.rstrip("\n") + "\n"


def authored_by(mail: bytes, identity: str) -> bytes:
    """``mail`` with ``identity`` as its ``From:``, the author ``git am`` records."""
    match = _IDENTITY.match(identity)
    if not match or _PLACEHOLDER_FROM not in mail:
        raise WorkbenchError(f"cannot make {identity!r} the author of an exported mail")
    header = formataddr((match["name"], match["email"]), charset="utf-8")
    return mail.replace(_PLACEHOLDER_FROM, f"\nFrom: {header}\n".encode(), 1)


FORMAT_PATCH_FLAGS = (
    "--stdout",
    "--zero-commit",
    "--no-signature",
    "--no-stat",
    "--full-index",
    "--keep-subject",
    "--no-renames",
    "--no-binary",
    "--encode-email-headers",
)
_MAIL_START = re.compile(rb"^From 0{40} Mon Sep 17 00:00:00 2001\n", re.MULTILINE)


def format_patches(repo: Path) -> list[bytes]:
    """One mail per commit on top of the base, in order."""
    stream = git(repo, "format-patch", *FORMAT_PATCH_FLAGS, f"{BASE_REF}..HEAD")
    starts = [m.start() for m in _MAIL_START.finditer(stream)]
    ends = starts[1:] + [len(stream)] if starts else []
    return [stream[s:e] for s, e in zip(starts, ends, strict=True)]


def am_onto_base(repo: Path, mails: list[bytes]) -> str:
    """``git am`` the mails onto ``repo``'s base commit, the pristine tree;
    return the resulting tree id. ``repo`` (built by ``build_repo`` or
    ``derive.build_derived``, clean) is on branch ``stack`` again after.

    The base commit is the one a fresh repository of the pristine tree gets
    (``init_base`` is deterministic), so this is the round trip onto a fresh
    tree, without copying and hashing the release's files once more.
    """
    git(repo, "checkout", "--quiet", "--detach", BASE_REF)
    if mails:
        git(repo, "am", "--quiet", "--keep", "--keep-cr", input=b"".join(mails))
    tree = git_text(repo, "rev-parse", "HEAD^{tree}").strip()
    git(repo, "checkout", "--quiet", "stack")
    return tree


def export(
    stack: Stack,
    out_dir: Path,
    *,
    source: Path | None = None,
    signoff: str | None = None,
    next_release: bool = False,
) -> list[Path]:
    """Write ``NNNN-<entry>.patch`` per entry into ``out_dir``; return the paths.

    Each commit is authored and signed off by ``signoff_identity(signoff)``,
    which raises
    before anything is built or written if there is no real identity.
    """
    identity = signoff_identity(signoff)
    if next_release:
        source = upstream.next_pristine_tree()
    source = source or upstream.pristine_tree()
    with tempfile.TemporaryDirectory(prefix="kvlc-export-") as tmp:
        stack = replace(
            stack,
            entries=tuple(
                replace(e, message=signed_off(e.message, identity, Path(tmp)))
                for e in stack.entries
            ),
        )
        repo = Path(tmp) / "stack"
        if next_release:
            _, unresolved = derive.build_derived(stack, repo, trailers=False, link=True)
            if unresolved:
                raise WorkbenchError(
                    f"the stack does not derive onto vLLM {upstream.NEXT_RELEASE} "
                    "without a person (./wb derive says what):\n"
                    + "\n".join(unresolved)
                )
        else:
            # Only GNU patch, format-patch and am touch its work tree.
            build_repo(stack, repo, source=source, trailers=False, sparse=True)
        mails = [authored_by(mail, identity) for mail in format_patches(repo)]
        if len(mails) != len(stack.entries):
            raise WorkbenchError(
                f"format-patch gave {len(mails)} patches for "
                f"{len(stack.entries)} entries"
            )
        expected_tree = git_text(repo, "rev-parse", "HEAD^{tree}").strip()
        actual_tree = am_onto_base(repo, mails)
        if actual_tree != expected_tree:
            raise WorkbenchError(
                f"git am of the export gives tree {actual_tree}, the stack gives "
                f"{expected_tree}; the export was not written"
            )
    staged = {
        f"{i:04d}-{entry.name}.patch": mail
        for i, (entry, mail) in enumerate(zip(stack.entries, mails, strict=False), 1)
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.patch"):
        if old.name not in staged:
            old.unlink()
    written = []
    for name, data in staged.items():
        path = out_dir / name
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
        written.append(path)
    return written
