"""Where a step's documents come from, chosen by ``data.kind`` through `DATA_KINDS`.

A data kind is a class registered in `DATA_KINDS` (``@DATA_KINDS.register(kind)``), named after its
``data.kind`` (`RolloutsKind`, `GenerateKind`, `StreamKind`), and built from the validated config and
the run directory. It checks its own config rules (``check_config``, on the typed config of a training
command, with the others, once the keys of ``checks_read`` are valid), names the top-level groups it
reads besides ``data`` (``groups``), tells the vocabulary a tiny model should get when
``model.vocab_size`` is null (``default_vocab_size``), and makes each rank's `StepSource`
(``source_factory(policy)``). Only the kinds that generate with the model keep the policy.
"""

from __future__ import annotations

from rlcli.training.sources.base import DATA_KINDS, DataKind, StepSource
from rlcli.training.sources.files import RolloutsKind
from rlcli.training.sources.generate import GenerateKind
from rlcli.training.sources.stream import StreamKind

# the top-level groups some data kind reads: present without such a kind, they are a config error
GROUPS_OF_DATA_KINDS = tuple(dict.fromkeys(group for kind in DATA_KINDS.values() for group in kind.groups))

__all__ = [
    "DATA_KINDS", "GROUPS_OF_DATA_KINDS", "DataKind", "GenerateKind", "RolloutsKind", "StepSource", "StreamKind",
]
