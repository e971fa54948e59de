"""The JVM processes of the devstack (Kafka, Connect, the schema registry): find a Java, build a
``java`` command line, and resolve jars from Maven Central into a cache folder."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path

from oncely.devstack._process import run_tool
from oncely.errors import DevstackError, ToolMissingError

_MIN_JAVA = 17
_INSTALL_JAVA = "Debian: apt-get install default-jre-headless"
_DOCKER_HINT = "Docker users can run `docker compose up -d postgres kafka` instead."


def cache_root() -> Path:
    """Where resolved classpaths live: ``$ONCELY_CACHE_DIR`` or ``~/.cache/oncely``."""
    configured = os.environ.get("ONCELY_CACHE_DIR")
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "oncely"


def check_java() -> str:
    """Return the path of a Java 17+ ``java``; raise :class:`ToolMissingError` otherwise."""
    java = shutil.which("java")
    if java is None:
        raise ToolMissingError(
            f"`java` was not found on PATH: the Kafka broker needs Java {_MIN_JAVA}+ "
            f"({_INSTALL_JAVA}). {_DOCKER_HINT}"
        )
    major, reported = java_version(java)
    if major < _MIN_JAVA:
        raise ToolMissingError(
            f"the Kafka broker needs Java {_MIN_JAVA}+, but {java} reports {reported}: put a "
            f"Java {_MIN_JAVA}+ first on PATH ({_INSTALL_JAVA}). {_DOCKER_HINT}"
        )
    return java


def java_version(java: str) -> tuple[int, list[str]]:
    """The major version of the ``java`` executable (0 when unknown) and the first line of
    what its ``-version`` prints (as a one-item list, empty when it prints nothing)."""
    out = subprocess.run([java, "-version"], capture_output=True, text=True, check=False)
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    major = int(match.group(1)) if match else 0
    if major == 1 and match and match.group(2):
        major = int(match.group(2))
    return major, (out.stderr or out.stdout).strip().splitlines()[:1]


def jvm_command(
    java: str,
    *,
    heap: tuple[str, str],
    logs: Path,
    log_config: str,
    libs: Path,
    main_class: str,
    properties: Mapping[str, str] | None = None,
) -> list[str]:
    """The command line of a Kafka process (broker or Connect worker) run by ``java`` (from
    :func:`check_java`): ``heap`` (initial, maximum), G1, its log4j2 configuration (a packaged
    file, written beside ``logs``), more system ``properties``, the jars of ``libs``."""
    config = logs.parent / "log4j2.properties"
    config.write_bytes(resources.files(__package__).joinpath(log_config).read_bytes())
    return [
        java,
        f"-Xms{heap[0]}",
        f"-Xmx{heap[1]}",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-Djava.awt.headless=true",
        f"-Dkafka.logs.dir={logs}",
        f"-Dlog4j2.configurationFile={config}",
        *(f"-D{name}={value}" for name, value in (properties or {}).items()),
        "-cp",
        f"{libs}/*",
        main_class,
    ]


def resolve_once(home: Path, ready: Callable[[], bool], resolve: Callable[[], None]) -> None:
    """Run ``resolve`` unless ``ready()``, one process at a time per cache folder ``home``
    (an exclusive lock on ``home/.lock``): two that start together (two test workers on a
    clean machine, two ``oncely dev up``) resolve once, and the one that waited finds it
    ready."""
    if ready():
        return
    home.mkdir(parents=True, exist_ok=True)
    with (home / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready():
            resolve()


def copy_dependencies(
    home: Path,
    pom: str,
    properties: Mapping[str, str],
    *,
    wanted: str,
    resolves: str,
    missing_hint: str = _DOCKER_HINT,
) -> Path:
    """Run Maven's ``dependency:copy-dependencies`` (runtime scope) on the packaged ``pom``
    with ``properties`` into a new ``home/libs.partial``, and return that folder.

    Raises:
        ToolMissingError: Maven is missing (says it ``resolves`` what, then ``missing_hint``).
        DevstackError: Maven failed, or no file of the folder matches the glob ``wanted``
            (with Maven's own output).
    """
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ToolMissingError(
            f"`mvn` (Apache Maven) was not found on PATH: it resolves {resolves} from Maven "
            f"Central (Debian: apt-get install maven). {missing_hint}"
        )
    home.mkdir(parents=True, exist_ok=True)
    pom_file = home / "pom.xml"
    pom_file.write_bytes(resources.files(__package__).joinpath(pom).read_bytes())
    staging = home / "libs.partial"
    shutil.rmtree(staging, ignore_errors=True)
    run_tool(
        [
            mvn,
            "-q",
            "-B",
            "-f",
            str(pom_file),
            "dependency:copy-dependencies",
            *(f"-D{name}={value}" for name, value in properties.items()),
            f"-DoutputDirectory={staging}",
            "-DincludeScope=runtime",
        ],
        doing=f"Maven resolving {resolves} (check the versions and that Maven Central is "
        "reachable)",
    )
    if not any(staging.glob(wanted)):
        raise DevstackError(f"Maven resolved {resolves} but {staging} holds no {wanted}")
    return staging
