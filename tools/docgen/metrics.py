"""The metrics reference page."""


def render() -> str:
    return "# TODO\n"
