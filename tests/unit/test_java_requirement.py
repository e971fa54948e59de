"""One Java requirement, stated the same way everywhere: Java 17+ for the Kafka broker (and
Kafka Connect), Java 21+ for the Apicurio schema registry the tests start; as the devstack
checks them."""

from __future__ import annotations

import re
from pathlib import Path

from oncely.devstack import jvm, registry

ROOT = Path(__file__).resolve().parents[2]
#: Where a reader learns what to install (the CHANGELOG is history and stays as written).
STATED_IN = [
    ROOT / "README.md",
    ROOT / "Makefile",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "src").rglob("*.py")),
]
#: The line of the README and the quickstart (whitespace aside).
JAVA_LINE = (
    "**Java 17+ runs the Kafka broker (`java` on `PATH`), and `make test` also needs Java 21+ "
    "for the Apicurio schema registry of its schema-registry tests (`JAVA_HOME`, `java` on "
    "`PATH` or a JDK in `/usr/lib/jvm`)**"
)


def _text(path: Path) -> str:
    return " ".join(path.read_text(encoding="utf-8").split())


def test_every_stated_java_version_is_the_one_the_devstack_checks() -> None:
    assert (jvm._MIN_JAVA, registry._MIN_JAVA) == (17, 21)
    stated = {
        f"{path.relative_to(ROOT)}: Java {version}+"
        for path in STATED_IN
        for version in re.findall(r"Java (\d+)\+", path.read_text(encoding="utf-8"))
        if int(version) not in (jvm._MIN_JAVA, registry._MIN_JAVA)
    }
    assert not stated, "a Java version the code does not check"
    stale = [path for path in STATED_IN if "openjdk-17" in path.read_text(encoding="utf-8")]
    assert not stale, "openjdk-17 is not in Debian 13: name default-jre-headless"


def test_the_readme_the_quickstart_and_the_makefile_state_the_same_line() -> None:
    for page in ("README.md", "docs/quickstart.md"):
        assert JAVA_LINE in _text(ROOT / page), page
    makefile = " ".join(
        line.removeprefix("#").strip()
        for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    )
    assert JAVA_LINE.replace("**", "").replace("`", "") in makefile
