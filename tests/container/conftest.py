"""The container tests: the image (``make image``) run by podman against the test services.

``make test-container`` installs podman and the rest, builds the images and runs these; plain
``make test`` deselects them (marker ``container``).
"""

from __future__ import annotations

import pytest

from tests.container.podman import IMAGE, podman


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(__file__.rsplit("/", 1)[0]):
            item.add_marker(pytest.mark.container)


@pytest.fixture(scope="session")
def image() -> str:
    """The image under test, which must exist (a missing one fails, never skips)."""
    if podman("image", "exists", IMAGE, check=False).returncode != 0:
        pytest.fail(f"no image {IMAGE} in podman's store: run `make image` first", pytrace=False)
    return IMAGE
