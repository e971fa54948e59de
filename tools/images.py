"""Build oncely's image and local Kafka, PostgreSQL and Kafka Connect images, with podman.

Run from the repository root (``make image`` runs the first)::

    python -m tools.images oncely [--tag oncely:dev] [--extras confluent]
    python -m tools.images kafka     # localhost/oncely-kafka:<version>: apache/kafka's interface
    python -m tools.images postgres  # localhost/oncely-postgres:15: the postgres image's interface
    python -m tools.images connect   # localhost/oncely-connect:<debezium>: debezium/connect's
    python -m tools.images base      # the Debian base they are all built on

No container registry is reachable on this repository's machines, so every base is built here:
``debootstrap --variant=minbase`` of Debian bookworm with python3, imported into podman. Its
root file system is cached as a tarball in ``<oncely cache>/images`` and the image in podman's
own store, so only the first run pays for it (about a minute). Kafka's jars come from Maven
Central (deploy/images/kafka/pom.xml, cached beside the base); Java and PostgreSQL are Debian's.

Package registries are reached through the host's CA bundle (``PIP_CERT`` or the system one): a
build mounts it read-only and points pip at it; it is never copied into an image.
"""

from __future__ import annotations

import argparse
import os
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Sequence
from pathlib import Path

from oncely.devstack.connect import DEFAULT_DEBEZIUM_VERSION, resolve_connect
from oncely.devstack.jvm import cache_root
from oncely.devstack.kafka import DEFAULT_KAFKA_VERSION
from oncely.errors import DevstackError, ToolMissingError

ROOT = Path(__file__).resolve().parents[1]
CONTAINERS_CONF = ROOT / "deploy" / "podman" / "containers.conf"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
BASE_IMAGE = f"localhost/oncely-base:debian-{SUITE}"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
KAFKA_IMAGE = f"localhost/oncely-kafka:{DEFAULT_KAFKA_VERSION}"
POSTGRES_IMAGE = "localhost/oncely-postgres:15"
CONNECT_IMAGE = f"localhost/oncely-connect:{DEFAULT_DEBEZIUM_VERSION}"
KAFKA_CONTEXT = ROOT / "deploy" / "images" / "kafka"
#: Left out of the base's root file system: documentation, locales, package lists.
_TRIMMED = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/lib/apt/lists",
    "var/cache/apt",
)


def podman_environment() -> dict[str, str]:
    """The environment for podman: the repository's containers.conf unless one is chosen."""
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return env


def podman(*args: str, check: bool = True) -> int:
    """Run ``podman ARGS`` and return its exit status (``CalledProcessError`` if ``check``)."""
    if shutil.which("podman") is None:
        raise ToolMissingError(
            "`podman` was not found on PATH (Debian: apt-get install podman runc; "
            "`make image` installs them)"
        )
    return subprocess.run(["podman", *args], env=podman_environment(), check=check).returncode


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False) == 0


def ca_bundle() -> Path | None:
    """The host's CA bundle that pip uses (``PIP_CERT``, else the system default), if any."""
    configured = os.environ.get("PIP_CERT") or ssl.get_default_verify_paths().cafile
    return Path(configured) if configured and Path(configured).is_file() else None


def registry_access() -> list[str]:
    """``podman build`` options that let a ``RUN pip install`` trust the host's CA bundle."""
    bundle = ca_bundle()
    if bundle is None:
        return []
    return ["--volume", f"{bundle}:{bundle}:ro", "--build-arg", f"PIP_CERT={bundle}"]


def build_base() -> str:
    """The Debian base image, imported from the cached root file system (built if missing)."""
    if image_exists(BASE_IMAGE):
        return BASE_IMAGE
    cached = cache_root() / "images" / f"debian-{SUITE}-python3.tar"
    if not cached.exists():
        if shutil.which("debootstrap") is None:
            raise ToolMissingError(
                "`debootstrap` was not found on PATH: it builds the images' Debian base "
                "(Debian: apt-get install debootstrap)"
            )
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="oncely-rootfs-") as scratch:
            rootfs = Path(scratch) / SUITE
            print(f"debootstrap {SUITE} into {rootfs} (about a minute, once)", flush=True)
            subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(BASE_PACKAGES)}",
                    SUITE,
                    str(rootfs),
                    MIRROR,
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            for trimmed in _TRIMMED:
                shutil.rmtree(rootfs / trimmed, ignore_errors=True)
            partial = cached.with_suffix(".partial")
            with tarfile.open(partial, "w") as tar:
                tar.add(rootfs, arcname=".")
            partial.rename(cached)
    podman(
        "import",
        "--change",
        'CMD ["/bin/bash"]',
        "--change",
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        str(cached),
        BASE_IMAGE,
    )
    return BASE_IMAGE


def project_version() -> str:
    with (ROOT / "pyproject.toml").open("rb") as file:
        return str(tomllib.load(file)["project"]["version"])


def git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return result.stdout.strip()


def build_oncely(tag: str, extras: str) -> None:
    base = build_base()
    podman(
        "build",
        "--format",
        "docker",
        "--tag",
        tag,
        "--build-arg",
        f"BASE_IMAGE={base}",
        "--build-arg",
        f"EXTRAS={extras}",
        "--build-arg",
        f"VERSION={project_version()}",
        "--build-arg",
        f"SOURCE={git('remote', 'get-url', 'origin')}",
        "--build-arg",
        f"REVISION={git('rev-parse', 'HEAD')}",
        *registry_access(),
        str(ROOT),
    )


def kafka_libs() -> Path:
    """The local Kafka image's jars (the broker and kafka-tools), resolved once with Maven."""
    libs = cache_root() / "images" / f"kafka-{DEFAULT_KAFKA_VERSION}-libs"
    if libs.is_dir():
        return libs
    if shutil.which("mvn") is None:
        raise ToolMissingError("`mvn` was not found on PATH (Debian: apt-get install maven)")
    partial = libs.with_suffix(".partial")
    shutil.rmtree(partial, ignore_errors=True)
    subprocess.run(
        [
            "mvn",
            "-q",
            "-B",
            "-f",
            str(KAFKA_CONTEXT / "pom.xml"),
            "dependency:copy-dependencies",
            "-DincludeScope=runtime",
            f"-Dkafka.version={DEFAULT_KAFKA_VERSION}",
            f"-DoutputDirectory={partial}",
        ],
        check=True,
    )
    partial.rename(libs)
    return libs


def build_kafka() -> None:
    base = build_base()
    libs = kafka_libs()
    with tempfile.TemporaryDirectory(prefix="oncely-kafka-image-") as scratch:
        context = Path(scratch)
        shutil.copytree(KAFKA_CONTEXT, context, dirs_exist_ok=True)
        shutil.copytree(libs, context / "libs")
        podman(
            "build",
            "--format",
            "docker",
            "--tag",
            KAFKA_IMAGE,
            "--build-arg",
            f"BASE_IMAGE={base}",
            "--build-arg",
            f"KAFKA_VERSION={DEFAULT_KAFKA_VERSION}",
            str(context),
        )


def build_connect() -> None:
    base = build_base()
    libs, plugins = resolve_connect()
    with tempfile.TemporaryDirectory(prefix="oncely-connect-image-") as scratch:
        context = Path(scratch)
        shutil.copytree(ROOT / "deploy" / "images" / "connect", context, dirs_exist_ok=True)
        shutil.copytree(libs, context / "libs")
        shutil.copytree(plugins, context / "plugins")
        podman(
            "build",
            "--format",
            "docker",
            "--tag",
            CONNECT_IMAGE,
            "--build-arg",
            f"BASE_IMAGE={base}",
            "--build-arg",
            f"DEBEZIUM_VERSION={DEFAULT_DEBEZIUM_VERSION}",
            str(context),
        )


def build_postgres() -> None:
    podman(
        "build",
        "--format",
        "docker",
        "--tag",
        POSTGRES_IMAGE,
        "--build-arg",
        f"BASE_IMAGE={build_base()}",
        str(ROOT / "deploy" / "images" / "postgres"),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.images", description=__doc__.split("\n")[0]
    )
    parser.add_argument("image", choices=["oncely", "kafka", "postgres", "connect", "base"])
    parser.add_argument("--tag", default="oncely:dev", help="the oncely image's tag")
    parser.add_argument("--extras", default="confluent", help="oncely's extras in the image")
    args = parser.parse_args(argv)
    try:
        if args.image == "oncely":
            build_oncely(args.tag, args.extras)
        elif args.image == "kafka":
            build_kafka()
        elif args.image == "postgres":
            build_postgres()
        elif args.image == "connect":
            build_connect()
        else:
            build_base()
    except DevstackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        print(
            f"error: {' '.join(map(str, exc.cmd[:3]))} ... exited {exc.returncode}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
