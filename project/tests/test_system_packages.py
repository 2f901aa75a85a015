"""``project/ci/system-packages``, which ``./wb test`` runs first: installs the
end-to-end tests' Debian packages when it can, else stops at once with one line.

The machine is simulated: PATH holds only the tools the script uses plus fakes
of ``redis-server``, ``ldconfig``, ``id`` and ``apt-get``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO
from workbench import syspkgs

SCRIPT = REPO / "project" / "ci" / "system-packages"
LIBIBVERBS = "\tlibibverbs.so.1 (libc6,x86-64) => /usr/lib/libibverbs.so.1"


def machine(
    tmp_path: Path, *, redis: bool, ibverbs: bool, uid: int, apt: bool
) -> dict[str, str]:
    """An environment whose PATH is a fake machine with these properties.
    A fake apt-get "installs" both packages and logs its arguments.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "grep", "cat", "tail", "rm", "mktemp", "touch", "chmod"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)

    def fake(name: str, body: str) -> None:
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)

    state = tmp_path / "state"
    state.mkdir()
    if redis:
        (state / "redis").touch()
    if ibverbs:
        (state / "ibverbs").touch()
    fake("id", f"echo {uid}")
    fake(
        "ldconfig",
        f'[ -e {state}/ibverbs ] && printf "%s\\n" "{LIBIBVERBS}"; exit 0',
    )
    # `command -v redis-server` finds it once the fake apt-get made it.
    if redis:
        fake("redis-server", "exit 0")
    if apt:
        fake(
            "apt-get",
            f'echo "$*" >> {tmp_path}/apt.log\n'
            f'if [ "$1" = install ]; then touch {state}/ibverbs; '
            f'printf "#!/bin/bash\\n" > {bin_dir}/redis-server; '
            f"chmod +x {bin_dir}/redis-server; fi",
        )
    return {"PATH": str(bin_dir), "HOME": str(tmp_path)}


def run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_nothing_to_do_when_both_are_there(tmp_path: Path):
    env = machine(tmp_path, redis=True, ibverbs=True, uid=1000, apt=False)
    result = run([str(SCRIPT)], env)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_root_with_apt_installs_what_is_missing_and_says_so(tmp_path: Path):
    env = machine(tmp_path, redis=False, ibverbs=False, uid=0, apt=True)
    result = run([str(SCRIPT)], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "installing redis-server libibverbs1 with apt-get "
        "(the end-to-end tests need them)"
    ]
    apt = (tmp_path / "apt.log").read_text().splitlines()
    assert apt[0] == "update -qq"
    assert apt[1].split()[-2:] == ["redis-server", "libibverbs1"]


def test_without_root_or_apt_it_stops_with_one_line(tmp_path: Path):
    env = machine(tmp_path, redis=True, ibverbs=False, uid=1000, apt=True)
    result = run([str(SCRIPT)], env)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: the end-to-end tests need the Debian packages libibverbs1: "
        "run 'sudo apt-get install libibverbs1', then again"
    ]
    assert not (tmp_path / "apt.log").exists()


def test_wb_test_stops_in_its_first_seconds_when_it_cannot_install(tmp_path: Path):
    env = machine(tmp_path, redis=False, ibverbs=True, uid=1000, apt=False)
    started = time.monotonic()
    result = run([sys.executable, str(REPO / "wb"), "test"], env)
    assert time.monotonic() - started < 30
    assert result.returncode == 1
    assert "error: the end-to-end tests need the Debian packages redis-server" in (
        result.stderr
    )
    # It stopped before installing anything.
    assert ".venv" not in result.stdout, result.stdout


def test_for_names_its_command_and_checks_only_its_packages(tmp_path: Path):
    env = machine(tmp_path, redis=False, ibverbs=True, uid=1000, apt=False)
    result = run([str(SCRIPT), "--for", "./wb x", "libibverbs1"], env)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    result = run([str(SCRIPT), "--for", "./wb x", "redis-server"], env)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: ./wb x needs the Debian packages redis-server (or their "
        "equivalents): install them and run again"
    ]


def test_wb_bench_ttft_stops_in_its_first_seconds_when_it_cannot_install(
    tmp_path: Path,
):
    """The Mooncake and Redis peers' packages, before any environment (the
    bench's plotting venv, .venv, LMCache's venv) is built."""
    env = machine(tmp_path, redis=False, ibverbs=False, uid=1000, apt=False)
    started = time.monotonic()
    result = run([sys.executable, str(REPO / "wb"), "bench", "--ttft"], env)
    assert time.monotonic() - started < 30
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: ./wb bench --ttft needs the Debian packages redis-server "
        "libibverbs1 (or their equivalents): install them and run again"
    ]
    assert result.stdout == ""
    # The tools venv goes to the cache under HOME: nothing was made there.
    assert not (tmp_path / ".cache").exists()


def test_wb_bench_ttft_needs_the_packages_of_the_systems_it_measures():
    assert syspkgs.for_ttft([]) == ["redis-server", "libibverbs1"]
    assert syspkgs.for_ttft(["--systems", "mooncake", "store-dir"]) == [
        "libibverbs1"
    ]
    assert syspkgs.for_ttft(["--repeats", "2", "--systems", "store-redis"]) == [
        "redis-server"
    ]
    assert syspkgs.for_ttft(["--systems", "store-dir", "lmcache"]) == []
    assert syspkgs.for_ttft(["--from-json", "x.json"]) == []
    assert syspkgs.for_ttft(["--help"]) == []


def test_every_ttft_system_with_a_peer_package_is_a_ttft_system():
    sys.path.insert(0, str(REPO / "project" / "bench"))
    import ttft

    assert set(syspkgs.TTFT_SYSTEMS) <= set(ttft.SYSTEMS)


def test_wb_demo_with_a_mooncake_connector_stops_when_it_cannot_install(
    tmp_path: Path,
):
    env = machine(tmp_path, redis=True, ibverbs=False, uid=1000, apt=False)
    config = '{"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}'
    result = run(
        [sys.executable, str(REPO / "wb"), "demo", "--kv-transfer-config", config],
        env,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: ./wb demo needs the Debian packages libibverbs1 (or their "
        "equivalents): install them and run again"
    ]
    assert ".venv" not in result.stdout, result.stdout
    # Its default connector and the Redis backend (the user's Redis) need none.
    assert syspkgs.for_demo([]) == []
    redis = '{"kv_connector": "StoreConnector", "kv_connector_extra_config": '
    redis += '{"backend": "redis", "redis_url": "redis://h:6379/0"}}'
    assert syspkgs.for_demo(["--kv-transfer-config", redis]) == []
