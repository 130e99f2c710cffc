"""The cli reference page."""


def render() -> str:
    return "# TODO\n"
