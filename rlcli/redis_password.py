"""A Redis password never written in clear: it leaves ``data.url`` at the command line for the environment.

`hide_password` takes the password out of a ``data.url=redis://:PASSWORD@host...`` override and puts it
in `PASSWORD_ENV`, leaving ``redis://:****@host...``: Hydra's ``.hydra/`` files, ``config.yaml``, the
checkpoints' hyper-parameters, ``manifest.json``, the logs and the console only ever see the masked URL.
The processes a command starts (samplers, trainer, Lightning's ranks) inherit the environment, which
unlike a command line only the user can read. `revealed` puts the password back where a client connects.
"""

from __future__ import annotations

import os
import re
from urllib.parse import quote, unquote

from rlcli.errors import UserError

PASSWORD_ENV = "RLCLI_REDIS_PASSWORD"
MASK = "****"
URL_KEY = re.compile(r"\+{0,2}data\.url=")  # an override of data.url, plain, added or forced
# scheme://[user]:PASSWORD@ or ?password=PASSWORD (a password with / , @ & or spaces is percent-encoded)
PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s,]*:)(?P<password>[^@/\s,]+)(?=@)"
                      r"|(?P<query>[?&]password=)(?P<in_query>[^&\s,]+)", re.IGNORECASE)


def _password(match: re.Match) -> str:
    """The password a `PASSWORD` match found, as the URL writes it (percent-encoded)."""
    return match["password"] or match["in_query"]


def _with_password(url: str, password: str) -> str:
    """``url`` with ``password`` in place of each password it holds."""
    return PASSWORD.sub(lambda m: f"{m['head'] or m['query']}{password}", url)


def masked(url: str) -> str:
    """``url`` with its password, if any, shown as ``****`` (for messages)."""
    return _with_password(url, MASK)


def hide_password(args: list[str]) -> list[str]:
    """``args`` with the password of a ``data.url`` override masked and put in `PASSWORD_ENV`; a
    `UserError` when the overrides give different passwords (the environment holds one)."""
    hidden = []
    for arg in args:
        if URL_KEY.match(arg):
            passwords = {unquote(_password(m)) for m in PASSWORD.finditer(arg)} - {MASK}
            if len(passwords) > 1:
                raise UserError("data.url: the URLs give different passwords; rlcli keeps one (in "
                                f"{PASSWORD_ENV})")
            if passwords:
                os.environ[PASSWORD_ENV] = passwords.pop()
            arg = masked(arg)
        hidden.append(arg)
    return hidden


def revealed(url: str, key: str = "data.url") -> str:
    """``url`` with a masked password replaced by the one in `PASSWORD_ENV`; a `UserError` naming ``key``
    when that is not set."""
    match = PASSWORD.search(url)
    if match is None or _password(match) != MASK:
        return url
    password = os.environ.get(PASSWORD_ENV)
    if password is None:
        raise UserError(f"{key}: {url} hides its password ({MASK}) and {PASSWORD_ENV} is not set; set it to "
                        "the password, or write the password in the URL")
    return _with_password(url, quote(password, safe=""))
