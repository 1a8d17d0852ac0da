"""Building pipeswarm's container image with podman on a machine without Docker's engine or a
reachable container registry (`make docker-image`, and the fixture of `make docker-test`).

What this machine needs, measured here (docs/operations.md, "In a container"):
- the base: python:3.11-slim when it can be pulled; otherwise Debian bookworm (Python 3.11, the
  local torch wheel's ABI) made with `debootstrap --variant=minbase` from the machine's own Debian
  mirror and `podman import`ed as localhost/pipeswarm-base:bookworm (kept for the next build);
- torch: the local CPU wheel, mounted read-only into the build and installed by its path, so pip
  never looks for PyPI's multi-GB CUDA build;
- pip's configuration (index URLs, local file:// indexes) and CA bundle passed as build arguments
  and read-only mounts, never copied into the image;
- `--network host` for the build's pip (and everything else), and the podman flags of
  PIPESWARM_PODMAN (the Makefile's PODMAN: runc, cgroupfs, events in a file).

`python -m tests.container.image build [--image NAME]` builds and prints the times and the size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PODMAN_ENV = "PIPESWARM_PODMAN"
DEFAULT_PODMAN = "podman --runtime runc --cgroup-manager cgroupfs --events-backend file"
DEFAULT_IMAGE = "localhost/pipeswarm:cpu"
UPSTREAM_BASE = "docker.io/library/python:3.11-slim"
LOCAL_BASE = "localhost/pipeswarm-base:bookworm"
DEBIAN_SUITE = "bookworm"  # its python3 is 3.11, the ABI of the local torch wheel (cp311)
TORCH_VERSION = "2.13.0"
TORCH_WHEEL_GLOB = f"torch-{TORCH_VERSION}+cpu-cp311-*.whl"
BUILD_MOUNT = "/mnt/pipeswarm-build"  # where the build's read-only mounts appear inside RUN steps
PULL_TIMEOUT = 60.0  # a registry that resolves but never answers must not stall the build


class ImageBuildError(RuntimeError):
    """The image cannot be built here; the message says why in one line."""


def podman_command() -> list[str]:
    """podman with the flags this machine needs (the Makefile passes its PODMAN in PIPESWARM_PODMAN)."""
    return shlex.split(os.environ.get(PODMAN_ENV, DEFAULT_PODMAN))


def podman_missing() -> str | None:
    """Why podman cannot run here, or None when it can."""
    podman = podman_command()
    if shutil.which(podman[0]) is None:
        return f"{podman[0]} is not installed (make podman-deps installs it with apt as root)"
    result = subprocess.run([*podman, "info", "--format", "json"], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        return f"`{shlex.join([*podman, 'info'])}` failed: {result.stderr.strip()[-300:]}"
    return None


def run(args: list[str], timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, text=True, timeout=timeout, **kwargs)


def image_exists(name: str) -> bool:
    return run([*podman_command(), "image", "exists", name], capture_output=True).returncode == 0


def image_size(name: str) -> int:
    """The image's size in bytes, as podman reports it (all layers, uncompressed)."""
    result = run([*podman_command(), "image", "inspect", name, "--format", "{{.Size}}"], capture_output=True)
    if result.returncode != 0:
        raise ImageBuildError(f"cannot inspect {name}: {result.stderr.strip()}")
    return int(result.stdout.strip())


# ------------------------------------------------------------------------------------------------
# The base image


def debian_mirror() -> str | None:
    """The first Debian archive URI in this machine's apt sources (one-line or deb822 format), or None
    (then debootstrap uses its own default mirror)."""
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        for uri in re.findall(r"^\s*(?:URIs:|deb(?:\s+\[[^\]]*\])?)\s+(\S+)", text, flags=re.MULTILINE):
            if uri.rstrip("/").endswith("/debian"):
                return uri
    return None


def debootstrap_base(name: str = LOCAL_BASE) -> None:
    """Debian bookworm with python3 and venv, made with debootstrap and imported as `name`. Apt's
    lists and caches, docs, man pages and locales are dropped before the import (~130 MB left)."""
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("no base image: the registry is unreachable and debootstrap is not installed")
    with tempfile.TemporaryDirectory(prefix="pipeswarm-rootfs-", dir="/var/tmp") as tmp:
        root = Path(tmp) / "rootfs"
        mirror = debian_mirror()
        command = ["debootstrap", "--variant=minbase", "--include=python3,python3-venv", DEBIAN_SUITE, str(root)]
        print(f"building the base with debootstrap ({mirror or 'its default mirror'}) ...", flush=True)
        result = run([*command, *([mirror] if mirror else [])], capture_output=True)
        if result.returncode != 0:
            raise ImageBuildError(f"debootstrap failed: {(result.stdout + result.stderr).strip()[-500:]}")
        for junk in ("var/cache/apt", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale"):
            for child in (root / junk).glob("*"):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        archive = Path(tmp) / "rootfs.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(root, arcname=".")
        result = run([*podman_command(), "import", str(archive), name], capture_output=True)
        if result.returncode != 0:
            raise ImageBuildError(f"podman import failed: {result.stderr.strip()[-300:]}")


def ensure_base() -> str:
    """The base image to build on: an existing local one, the upstream one pulled, or a debootstrapped one."""
    for name in (UPSTREAM_BASE, LOCAL_BASE):
        if image_exists(name):
            return name
    try:
        pulled = run([*podman_command(), "pull", "-q", UPSTREAM_BASE], capture_output=True, timeout=PULL_TIMEOUT)
        if pulled.returncode == 0:
            return UPSTREAM_BASE
        reason = pulled.stderr.strip().splitlines()[-1] if pulled.stderr.strip() else f"exit {pulled.returncode}"
    except subprocess.TimeoutExpired:
        reason = f"no answer in {PULL_TIMEOUT:.0f} s"
    print(f"cannot pull {UPSTREAM_BASE} ({reason[:200]}); making {LOCAL_BASE} instead", flush=True)
    debootstrap_base(LOCAL_BASE)
    return LOCAL_BASE


# ------------------------------------------------------------------------------------------------
# pip inside the build


@dataclass
class PipSettings:
    """What the build's pip gets from this machine: build arguments and the read-only mounts they name."""

    build_args: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str]] = field(default_factory=list)  # (host path, path in the build)

    def flags(self) -> Iterator[str]:
        for key, value in self.build_args.items():
            yield from ("--build-arg", f"{key}={value}")
        for host, inside in self.mounts:
            yield from ("-v", f"{host}:{inside}:ro")


def host_pip_config() -> dict[str, str]:
    """This interpreter's pip settings (`pip config list`: files, then PIP_* variables, which win)."""
    result = run([sys.executable, "-m", "pip", "config", "list"], capture_output=True)
    config: dict[str, str] = {}
    for line in result.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key.split(".", 1)[-1]] = value.strip().strip("'\"")
    for key in ("index-url", "extra-index-url", "cert"):
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env:
            config[key] = env
    return config


def pip_settings(torch_wheels: Path) -> PipSettings:
    """Build arguments and mounts: the torch wheel by its path, this machine's indexes (file:// ones
    mounted at the same path) and its CA bundle."""
    wheels = sorted(torch_wheels.glob(TORCH_WHEEL_GLOB)) if torch_wheels.is_dir() else []
    if not wheels:
        raise ImageBuildError(
            f"no torch {TORCH_VERSION} CPU wheel for Python 3.11 ({TORCH_WHEEL_GLOB}) in {torch_wheels}: "
            "set TORCH_WHEELS to a folder holding one (PyPI's torch is the multi-GB CUDA build)"
        )
    settings = PipSettings()
    settings.mounts.append((str(torch_wheels), f"{BUILD_MOUNT}/wheels"))
    settings.build_args["TORCH_SPEC"] = f"{BUILD_MOUNT}/wheels/{wheels[-1].name}"
    config = host_pip_config()
    if config.get("index-url"):
        settings.build_args["PIP_INDEX_URL"] = config["index-url"]
    extra = config.get("extra-index-url", "").split()
    for url in extra:
        path = Path(url.removeprefix("file://"))
        if url.startswith("file://") and path.is_dir():
            # a PEP 503 folder's pages link their files as ../../files/...: mount the folder above it
            settings.mounts.append((str(path.parent), str(path.parent)))
    if extra:
        settings.build_args["PIP_EXTRA_INDEX_URL"] = " ".join(extra)
    cert = config.get("cert") or os.environ.get("SSL_CERT_FILE")
    if cert and Path(cert).is_file():
        settings.mounts.append((str(Path(cert).resolve()), f"{BUILD_MOUNT}/ca.crt"))
        settings.build_args["PIP_CERT"] = f"{BUILD_MOUNT}/ca.crt"
    return settings


# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildReport:
    image: str
    base: str
    base_seconds: float
    build_seconds: float
    size_bytes: int

    def line(self) -> str:
        return (
            f"image {self.image} on {self.base}: base ready in {self.base_seconds:.0f} s, "
            f"built in {self.build_seconds:.0f} s, {self.size_bytes / 1e6:.0f} MB"
        )


def build_image(image: str = DEFAULT_IMAGE, torch_wheels: Path = Path("/opt/wheels")) -> BuildReport:
    """Build the repo's Dockerfile into `image` with podman. Raises ImageBuildError with the reason."""
    missing = podman_missing()
    if missing:
        raise ImageBuildError(missing)
    settings = pip_settings(torch_wheels)
    started = time.monotonic()
    base = ensure_base()
    base_seconds = time.monotonic() - started
    command = [
        *podman_command(),
        "build",
        "--network",
        "host",  # the build's pip reaches the package index as the host does
        "--build-arg",
        f"BASE={base}",
        *settings.flags(),
        "-t",
        image,
        "-f",
        str(REPO / "Dockerfile"),
        str(REPO),
    ]
    print("$", shlex.join(command), flush=True)
    started = time.monotonic()
    if run(command).returncode != 0:
        raise ImageBuildError(f"podman build of {image} failed (its output is above)")
    return BuildReport(image, base, base_seconds, time.monotonic() - started, image_size(image))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.container.image")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build the image with podman")
    build.add_argument("--image", default=DEFAULT_IMAGE)
    build.add_argument("--torch-wheels", type=Path, default=Path("/opt/wheels"), help="folder with the torch wheel")
    build.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = build_image(args.image, args.torch_wheels)
    except ImageBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report.__dict__) if args.json else report.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
