"""The training harness: modes, trainer, checkpoints, metrics and progress.

``train_and_evaluate(config, workdir)`` runs one experiment config (see ``configs/``) in a
mode (``dense``, ``pipeline``, ``data_parallel``, ``ab``), resuming from the workdir's latest
checkpoint, and writes metrics, a plot and a summary table. ``apply_overrides(config,
{"pipeline.forward.fraction": 0.05})`` changes a config by dotted keys (the CLI's ``--set``).
"""

from jaxcomp.train._checkpoint import Checkpointer
from jaxcomp.train._config import DEFAULTS
from jaxcomp.train._config import MODES
from jaxcomp.train._config import build_channel
from jaxcomp.train._config import build_codec
from jaxcomp.train._config import learning_rate
from jaxcomp.train._config import optimizer
from jaxcomp.train._config import with_defaults
from jaxcomp.train._errors import Aborted
from jaxcomp.train._errors import CheckpointError
from jaxcomp.train._errors import Interrupted
from jaxcomp.train._errors import NonFiniteError
from jaxcomp.train._errors import PeerLost
from jaxcomp.train._errors import SetupError
from jaxcomp.train._errors import StorageError
from jaxcomp.train._errors import WorkdirInUse
from jaxcomp.train._lock import RunLock
from jaxcomp.train._metrics import MetricWriter
from jaxcomp.train._metrics import plot_metrics
from jaxcomp.train._metrics import read_metrics
from jaxcomp.train._metrics import summary_table
from jaxcomp.train._mode import Mode
from jaxcomp.train._mode import commit_if_finite
from jaxcomp.train._overrides import apply_overrides
from jaxcomp.train._overrides import parse_overrides
from jaxcomp.train._progress import Progress
from jaxcomp.train._signals import StopOnSignal
from jaxcomp.train._trainer import RunState
from jaxcomp.train._trainer import Setup
from jaxcomp.train._trainer import evaluate
from jaxcomp.train._trainer import setup
from jaxcomp.train._trainer import train_and_evaluate

__all__ = (
    "DEFAULTS",
    "MODES",
    "Aborted",
    "CheckpointError",
    "Checkpointer",
    "Interrupted",
    "MetricWriter",
    "Mode",
    "NonFiniteError",
    "PeerLost",
    "Progress",
    "Setup",
    "SetupError",
    "StorageError",
    "StopOnSignal",
    "RunLock",
    "RunState",
    "apply_overrides",
    "build_channel",
    "build_codec",
    "commit_if_finite",
    "evaluate",
    "learning_rate",
    "optimizer",
    "parse_overrides",
    "plot_metrics",
    "read_metrics",
    "setup",
    "summary_table",
    "train_and_evaluate",
    "with_defaults",
    "WorkdirInUse",
)
