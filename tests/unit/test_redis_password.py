"""A Redis password leaves ``data.url`` at the command line for the environment, and comes back where a
client connects."""

from __future__ import annotations

import os

import pytest

from rlcli.errors import UserError
from rlcli.redis_password import PASSWORD_ENV, hide_password, masked, revealed


def no_password(monkeypatch) -> None:
    """`PASSWORD_ENV` unset, and restored after the test (whatever the test sets)."""
    monkeypatch.setenv(PASSWORD_ENV, "")
    monkeypatch.delenv(PASSWORD_ENV)


@pytest.mark.parametrize("url, shown", [
    ("redis://:pw@host:6379/0", "redis://:****@host:6379/0"),
    ("rediss://alice:p%40ss@host:6380/1", "rediss://alice:****@host:6380/1"),
    ("redis://host:6379/0", "redis://host:6379/0"),
    ("unix:///run/redis.sock", "unix:///run/redis.sock"),
    ("unix:///run/redis.sock?db=1&password=pw", "unix:///run/redis.sock?db=1&password=****"),
])
def test_masked_hides_the_password_alone(url, shown):
    """Fails when a password is left in a message, or a URL without one is changed."""
    assert masked(url) == shown


def test_the_password_goes_to_the_environment_and_comes_back(monkeypatch):
    """Fails when an override keeps its password, or the client gets the mask instead of the password."""
    no_password(monkeypatch)
    args = ["trainer.max_steps=2", "data.url=rediss://alice:p%40ss@host:6380/1", "seed=1"]
    assert hide_password(args) == ["trainer.max_steps=2", "data.url=rediss://alice:****@host:6380/1", "seed=1"]
    assert os.environ[PASSWORD_ENV] == "p@ss"  # the URL's percent-encoding undone
    assert revealed("rediss://alice:****@host:6380/1") == "rediss://alice:p%40ss@host:6380/1"
    assert hide_password(["data.url=rediss://alice:****@host:6380/1"]) == ["data.url=rediss://alice:****@host:6380/1"]
    assert os.environ[PASSWORD_ENV] == "p@ss"  # a masked URL (a re-run of a saved command) leaves it


def test_a_masked_url_without_the_environment_and_two_passwords_are_user_errors(monkeypatch):
    no_password(monkeypatch)
    with pytest.raises(UserError, match=f"data.url: redis://:\\*\\*\\*\\*@h:1/0 hides its password .* {PASSWORD_ENV}"):
        revealed("redis://:****@h:1/0")
    with pytest.raises(UserError, match="different passwords"):
        hide_password(["data.url=redis://:a@h:1/0,redis://:b@h:2/0"])
