"""Sweeps as Slurm jobs (`launcher=slurm`): the launcher the driver runs, what a job does at its time limit,
and the queries of Slurm's queue and accounting they share."""
