"""rlcli's Hydra launcher, here because Hydra takes launchers from the ``hydra_plugins`` package only (and
by the module that defines them). Importing it registers its config, ``hydra/launcher/rlcli_slurm``."""

from rlcli.slurm.launcher import SlurmSweepLauncher


class SlurmLauncher(SlurmSweepLauncher):
    """`launcher=slurm`: `rlcli.slurm.launcher.SlurmSweepLauncher`."""
