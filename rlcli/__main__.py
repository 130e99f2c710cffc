from rlcli.cli import run

run()
