"""The config reference page."""


def render() -> str:
    return "# TODO\n"
