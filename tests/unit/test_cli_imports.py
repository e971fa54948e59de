"""load_object: 'package.module:attribute' with errors that name what failed."""

from __future__ import annotations

import pytest

from oncely.cli._imports import ImportTargetError, load_object
from oncely.errors import ConfigurationError
from oncely.events import Registry


def test_loads_a_module_attribute() -> None:
    assert isinstance(load_object("examples.payments.events:registry"), Registry)


def test_loads_a_dotted_attribute() -> None:
    assert load_object("oncely.events:Registry.get") is Registry.get


@pytest.mark.parametrize("target", ["examples.payments.events", ":registry", "module:", ""])
def test_malformed_target(target: str) -> None:
    with pytest.raises(ImportTargetError, match=r"not of the form 'package\.module:attribute'"):
        load_object(target)


def test_missing_module_names_it_and_the_cause() -> None:
    with pytest.raises(ImportTargetError, match=r"cannot import module 'no_such_mod'.*No module"):
        load_object("no_such_mod:registry")


def test_missing_attribute_is_named() -> None:
    with pytest.raises(ImportTargetError, match=r"has no attribute 'registri'"):
        load_object("examples.payments.events:registri")


def test_is_a_configuration_error() -> None:
    assert issubclass(ImportTargetError, ConfigurationError)
