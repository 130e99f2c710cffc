"""Developer tools of the repository (not shipped with rlcli): the docs' generated pages, the MkDocs hook."""
