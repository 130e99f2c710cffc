"""rlcli: a Hydra-configured command-line trainer for reinforcement learning on language models."""

__version__ = "0.1.0"
