"""The Docker image and compose file, checked without a Docker engine: the Dockerfile is
parsed and its entrypoint run as the container would run it (on loopback, with a
temporary folder for /data); the compose file's commands go through the real parser."""

import json
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

import multiaddr
import pytest
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from murmur import DISTRIBUTION
from murmur.node.net.identity import load_or_create_identity, peer_id_of
from murmur.node.net.membership import parse_bootstrap
from murmur.node.ops.run import build_run_parser
from murmur.node.ops.status import build_parser as build_status_parser

ROOT = Path(__file__).resolve().parent.parent
HEALTH_ARGV = ["murmur", "status", "--data-dir", "/data", "--health"]


def _instructions(name: str) -> list[str]:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    return [i["value"] for i in parser.structure if i["instruction"] == name]


def _only(name: str) -> str:
    values = _instructions(name)
    assert len(values) == 1, f"expected one {name}, found {values}"
    return values[0]


def _container_argv() -> list[str]:
    """What the container runs with no arguments: ENTRYPOINT then CMD, both in exec form."""
    return json.loads(_only("ENTRYPOINT")) + json.loads(_only("CMD"))


def _run_args(argv: list[str]):
    assert argv[:2] == ["murmur", "run"], argv
    return build_run_parser().parse_args(argv[2:])


def _healthcheck() -> tuple[dict[str, str], list[str]]:
    """The HEALTHCHECK's options and its exec-form command."""
    options, _, command = _only("HEALTHCHECK").partition("CMD")
    return dict(o.lstrip("-").split("=", 1) for o in shlex.split(options)), json.loads(command)


# --- Dockerfile ---------------------------------------------------------------------------


def test_base_image_is_a_cuda_pytorch_that_meets_the_torch_requirement() -> None:
    image = DockerfileParser(path=str(ROOT / "Dockerfile")).baseimage
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", image)
    assert match, image
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_req = next(Requirement(d) for d in dependencies if Requirement(d).name == "torch")
    # Otherwise `pip install .` would replace the image's torch with another multi-GB download.
    assert match.group(1) in torch_req.specifier, (match.group(1), str(torch_req))


def test_the_image_copies_everything_pip_install_needs_and_dockerignore_keeps_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = set(project["tool"]["setuptools"]["package-dir"].values())  # the folders: murmur, node, protocol
    needed = {"pyproject.toml", project["project"]["readme"], *packages}
    copied = {src for value in _instructions("COPY") for src in value.split()[:-1]}
    assert needed <= copied, needed - copied
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert not ignored & copied
    assert {".git", ".venv"} <= ignored  # a ~1 GB virtualenv must not reach the build context


def _sdist_only_dependencies() -> set[str]:
    """Murmur's installed dependencies (transitively) whose wheel pip built here: no manylinux wheel exists."""
    seen: set[str] = set()
    built: set[str] = set()
    todo = [DISTRIBUTION]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency this platform does not need
        wheel = dist.read_text("WHEEL") or ""
        tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
        if tags and all(t.endswith("-linux_x86_64") for t in tags):
            built.add(name)
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return built


def test_the_build_can_compile_dependencies_that_ship_no_wheel() -> None:
    built = _sdist_only_dependencies()
    if not built:
        pytest.skip("every dependency installed here came as a prebuilt wheel")
    install = next(run for run in _instructions("RUN") if "pip install ." in run)
    before_pip = install.split("pip install .")[0]
    assert "build-essential" in before_pip or "gcc" in before_pip, f"{sorted(built)} compile from source"


def test_runs_as_a_non_root_user_with_a_data_volume_and_the_p2p_port() -> None:
    user = _instructions("USER")[-1]
    assert user not in ("root", "0") and not user.startswith(("root:", "0:"))
    setup = " ".join(_instructions("RUN"))
    assert "useradd" in setup and user in setup and f"chown {user}" in setup and "/data" in setup
    assert _only("VOLUME") in ("/data", '["/data"]')
    assert _only("EXPOSE") in ("4001", "4001/tcp")


def test_entrypoint_is_murmur_run_on_the_volume_the_port_and_any_device() -> None:
    assert _container_argv()[:2] == ["murmur", "run"]
    args = _run_args(_container_argv())
    assert str(args.data_dir) == "/data"
    assert args.device == "auto"
    assert args.listen == ["/ip4/0.0.0.0/tcp/4001"]  # every interface, the EXPOSEd port
    # Options appended by `docker run IMAGE …` override single-valued ones.
    assert _run_args(_container_argv() + ["--device", "cpu"]).device == "cpu"


def test_healthcheck_runs_murmur_status_on_the_volume() -> None:
    options, command = _healthcheck()
    assert command == HEALTH_ARGV
    args = build_status_parser().parse_args(HEALTH_ARGV[2:])
    assert args.health and str(args.data_dir) == "/data"
    assert set(options) <= {"interval", "timeout", "start-period", "retries", "start-interval"}
    assert int(options["retries"]) >= 1 and options["start-period"].endswith(("s", "m"))


def test_the_entrypoint_starts_a_node(tmp_path: Path) -> None:
    """Run the container's argv: `murmur` is this venv's CLI, /data a temp folder, loopback only."""
    data_dir = tmp_path / "data"
    local = {"/data": str(data_dir), "/ip4/0.0.0.0/": "/ip4/127.0.0.1/", "/tcp/4001": "/tcp/0"}
    argv = _container_argv()
    for container, here in local.items():
        argv = [arg.replace(container, here) for arg in argv]
    assert argv[0] == "murmur"
    argv = [sys.executable, "-m", "murmur.node.cli", *argv[1:], "--eval-every", "1"]
    health = [sys.executable, "-m", "murmur.node.cli", *HEALTH_ARGV[1:]]
    health[health.index("/data")] = str(data_dir)
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        first_line = process.stdout.readline()  # blocks until the node listens or exits
        assert first_line.startswith("murmur: listening on /ip4/127.0.0.1/tcp/"), (first_line, log.read_text())
        deadline = time.monotonic() + 20
        while subprocess.run(health, check=False, cwd=ROOT, capture_output=True, timeout=60).returncode != 0:
            assert time.monotonic() < deadline and process.poll() is None, "never healthy while running"
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)  # as `docker stop` does: the node checkpoints and exits 0
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, log.read_text()
    assert (data_dir / "identity.key").exists() and list((data_dir / "checkpoints").glob("checkpoint-*.pt"))
    status = json.loads((data_dir / "status.json").read_text())
    assert status["device"] in ("cpu", "cuda:0", "mps")  # what --device auto found here
    gone = subprocess.run(health, check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and gone.stdout.startswith("unhealthy"), gone.stdout  # the node has exited


# --- scripts/docker_check.sh (builds and runs the image; too slow for the suite) -----------

CHECK_SCRIPT = ROOT / "scripts" / "docker_check.sh"


def _check_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CHECK_SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False)


def test_the_check_script_parses_and_explains_itself() -> None:
    assert subprocess.run(["bash", "-n", str(CHECK_SCRIPT)], capture_output=True, check=False).returncode == 0
    usage = _check_script("--help")
    assert usage.returncode == 0 and "scripts/docker_check.sh [--out FILE]" in usage.stdout, usage
    assert not usage.stdout.startswith("#")  # the header comment, printed as text
    wrong = _check_script("--bogus")
    assert wrong.returncode == 2 and "unknown argument --bogus" in wrong.stderr, wrong


def test_the_check_script_builds_a_base_whose_torch_the_image_keeps() -> None:
    script = CHECK_SCRIPT.read_text()
    pinned = re.search(r"^TORCH_VERSION=([\d.]+)$", script, re.MULTILINE).group(1)
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_req = next(Requirement(d) for d in dependencies if Requirement(d).name == "torch")
    assert pinned in torch_req.specifier, (pinned, str(torch_req))  # else `pip install .` fetches another torch
    assert re.search(r"pip install torch==\$TORCH_VERSION", script)
    assert '--build-arg "BASE_IMAGE=$BASE_IMAGE"' in script  # the Dockerfile's ARG
    assert "ARG BASE_IMAGE" in (ROOT / "Dockerfile").read_text()


def test_the_build_removes_the_packages_it_added_but_gmp() -> None:
    """The RUN's package bookkeeping, run on this machine's dpkg database where it has one: what it
    lists as installed is what dpkg says, and a package installed for the build alone would be purged."""
    install = next(run for run in _instructions("RUN") if "pip install ." in run)
    assert install.index("> /tmp/packages-before") < install.index("apt-get install")
    assert install.index("pip install .") < install.index("apt-get purge -y $(cat /tmp/packages-added)")
    if subprocess.run(["sh", "-c", "command -v dpkg-query"], capture_output=True, check=False).returncode:
        pytest.skip("no dpkg here")
    definition = install.split(" && ")[0]  # installed() { …; }
    assert definition.startswith("installed() {")
    listed = subprocess.run(["sh", "-c", f"{definition}; installed"], capture_output=True, text=True, check=True).stdout
    names = listed.splitlines()
    assert "dpkg" in names and len(set(names)) == len(names)
    # As the build computes the added packages: gmp's runtime library stays, the rest goes.
    added = "build-essential\ngcc\nlibgmp-dev:amd64\nlibgmp10:amd64\n"
    filter_ = install.split("comm -13 /tmp/packages-before - | ")[1].split(" > /tmp/packages-added")[0]
    kept = subprocess.run(["sh", "-c", filter_], input=added, capture_output=True, text=True, check=True).stdout
    assert kept.split() == ["build-essential", "gcc", "libgmp-dev:amd64"]


# --- docker-compose.yml -------------------------------------------------------------------


def _blocks(text: str, indent: int) -> dict[str, str]:
    """The keys at exactly `indent` spaces in a block-style YAML mapping, each with its text.

    A light reading for this file's structure (no YAML parser is a dependency): a key's
    text is the rest of its line plus the more deeply indented lines after it.
    """
    blocks: dict[str, list[str]] = {}
    key = None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = re.match(rf"^ {{{indent}}}([\w.<-]+):(.*)$", line)
        if match:
            key = match.group(1)
            blocks[key] = [match.group(2)]
        elif key is not None and len(line) - len(line.lstrip()) > indent:
            blocks[key].append(line)
        else:
            key = None
    return {k: "\n".join(v) for k, v in blocks.items()}


def _flow_list(block: str, key: str) -> list[str]:
    match = re.search(rf"^\s*{key}: (\[.*\])\s*$", block, re.MULTILINE)
    assert match, f"no {key}: [...] in {block!r}"
    return json.loads(match.group(1))


def test_compose_runs_a_bootstrap_node_and_gpu_peers_each_with_its_own_volume(tmp_path: Path) -> None:
    top = _blocks((ROOT / "docker-compose.yml").read_text(), 0)
    services = _blocks(top["services"], 2)
    peers = [name for name in services if name != "bootstrap"]
    assert "bootstrap" in services and peers
    bootstrap_ip = re.search(r"ipv4_address: ([\d.]+)", services["bootstrap"]).group(1)
    assert "build: ." in services["bootstrap"] and _flow_list(services["bootstrap"], "ports") == ["4001:4001"]

    template = top["x-peer"]
    assert re.search(r"driver: nvidia", template) and _flow_list(template, "capabilities") == ["gpu"]
    assert re.search(r"bootstrap:\s+condition: service_healthy", template)

    volumes = {name: _flow_list(body, "volumes") for name, body in services.items()}
    assert all(len(v) == 1 and v[0].endswith(":/data") for v in volumes.values())
    names = [v[0].split(":")[0] for v in volumes.values()]
    assert len(set(names)) == len(names) and set(names) <= set(_blocks(top["volumes"], 2))

    real_id = peer_id_of(load_or_create_identity(tmp_path))
    for name in peers:
        assert "<<: *peer" in services[name]
        required_id = "${BOOTSTRAP_ID:?run murmur id first: see docs/deploy.md}"
        command = [c.replace(required_id, real_id) for c in _flow_list(services[name], "command")]
        args = _run_args(_container_argv() + command)
        assert len(args.bootstrap) == 1
        peer_id, (addr,) = parse_bootstrap(args.bootstrap[0])
        assert peer_id == real_id
        assert multiaddr.Multiaddr(addr).value_for_protocol("ip4") == bootstrap_ip
        assert multiaddr.Multiaddr(addr).value_for_protocol("tcp") == "4001"
    assert _run_args(_container_argv() + _flow_list(services["bootstrap"], "command")).bootstrap == []


# --- the documented `docker run` lines ----------------------------------------------------

PLACEHOLDERS = {
    "<public ip>": "203.0.113.7",
    "<this machine's public ip>": "203.0.113.9",
    "<bootstrap ip>": "203.0.113.8",
}


def _documented_runs(path: Path, peer_id: str) -> list[list[str]]:
    """The `docker run … murmur OPTIONS` commands of a Markdown file, as the options after the image,
    with placeholders filled in (`peer_id` for every `<… peer id>`)."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())  # join continued lines
    text = re.sub(r"<[^>]*peer id>", peer_id, text)
    for placeholder, value in PLACEHOLDERS.items():
        text = text.replace(placeholder, value)
    runs = []
    for line in text.splitlines():
        line = line.strip()
        # `--entrypoint` lines run another command (murmur id); `…` marks an abbreviated line.
        if line.startswith("docker run") and "--entrypoint" not in line and "…" not in line:
            tokens = shlex.split(line)
            image = next(i for i, t in enumerate(tokens) if t == "murmur" and tokens[i - 1] != "--name")
            runs.append(tokens[image + 1 :])
    return runs


@pytest.mark.parametrize("doc", ["docs/operating.md", "docs/deploy.md"])
def test_documented_docker_runs_use_valid_murmur_run_options(doc: str, tmp_path: Path) -> None:
    peer_id = peer_id_of(load_or_create_identity(tmp_path))
    runs = _documented_runs(ROOT / doc, peer_id)
    assert runs
    for options in runs:
        args = _run_args(_container_argv() + options)
        for addr in args.bootstrap:
            assert parse_bootstrap(addr)[0] == peer_id
