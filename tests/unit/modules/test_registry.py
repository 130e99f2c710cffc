"""The one registry idiom: names in order, one entry per name, an error that lists the choices."""

import pytest

from rlcli.modules.registry import Registry, UnknownName


def test_entries_are_found_by_name_in_registration_order():
    table = Registry("widget")

    @table.register("b")
    def b():
        return 2

    @table.register()
    class A:
        name = "a"

    assert table.names() == ("b", "a")
    assert table["b"] is b and table["a"] is A
    assert "a" in table and "c" not in table and len(table) == 2


def test_an_unknown_name_lists_the_choices():
    table = Registry("widget")
    table.register("x")(object)
    with pytest.raises(UnknownName, match="unknown widget 'y'; expected one of: x"):
        table["y"]


def test_a_taken_name_is_refused_and_a_nameless_entry_too():
    table = Registry("widget")
    table.register("x")(int)
    table.register("x")(int)  # the same entry again: nothing changes
    with pytest.raises(ValueError, match="taken"):
        table.register("x")(str)
    with pytest.raises(ValueError, match="needs a name"):
        table.register()(float)
