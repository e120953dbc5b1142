"""Errors that carry a message meant for the user.

The CLI prints these as one clear message (no traceback); everything else is a bug.
"""


class SubmergeError(Exception):
    """Base class: bad input that the user can fix. The message says what and where."""


class ModelInputError(SubmergeError):
    """A model, checkpoint or adapter cannot be read or does not fit the base."""


class CheckpointMismatch(ModelInputError):
    """A fine-tune's tensors differ from the base's in names or shapes."""


class NonFiniteWeights(ModelInputError):
    """A tensor holds NaN or Inf values."""


class DataInputError(SubmergeError):
    """A task data file is missing, empty or malformed."""


class StoreError(SubmergeError):
    """A store exists with other settings, or cannot be written."""


class ArchitectureError(SubmergeError):
    """The model's structure (decoder blocks, attention, MLP) was not recognised."""


class SelectionError(SubmergeError, ValueError):
    """A name or pattern that selects tensors (``--matrices``) matches nothing in the model."""


class EngineError(SubmergeError):
    """The engine cannot run (Ray missing or unreachable, too few CPUs or GPUs in the cluster, a bad count, a
    worker that died or ran out of memory)."""
