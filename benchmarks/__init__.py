"""Benchmarks of rlcli. ``python -m benchmarks`` runs all of them; see each module's docstring."""
