"""rlcli's commands: each Hydra app (`rlcli train`, `sample`, `loop`, `eval`) is one task function behind
the one wrapper of `rlcli.commands.app`."""
