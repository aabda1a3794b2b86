"""Resilience: rewind to the last good snapshot on a fault, asynchronous checkpoints, fault injection.

``Rewind`` wraps the training step (see ``rewind``); ``CheckpointManager`` writes and finds
checkpoints (``checkpoint``); ``FaultInjector`` plans NaNs, exceptions and kills for tests and
demos (``faults``); ``check_finite_inputs`` is the input guard (``detect``); ``LocalPipeline``
runs stage modules in one process with the pipeline's step signature (``local``); ``names`` gives
a rank's state global names (reshardable checkpoints) and ``regroup`` fresh groups on a mesh.
"""

from .agree import Agreement, AgreementError, LocalReport, Verdict
from .checkpoint import CheckpointError, CheckpointManager
from .detect import BadInputError, FaultKind, LossSpikeDetector, check_finite_inputs
from .faults import KILL_EXIT_CODE, FaultInjector, InjectedFault
from .local import LocalPipeline
from .names import StateNames
from .regroup import rebuild_on_mesh, refresh_sync_groups
from .rewind import FaultEvent, Rewind, RewindConfig, RewindError, StepResult, fresh_group, rebuild_pipeline
from .snapshot import Snapshot, capture_rng, restore_rng, restore_snapshot, take_snapshot

__all__ = [
    "Rewind", "RewindConfig", "RewindError", "StepResult", "FaultEvent", "fresh_group", "rebuild_pipeline",
    "CheckpointManager", "CheckpointError", "FaultInjector", "InjectedFault", "KILL_EXIT_CODE",
    "FaultKind", "LossSpikeDetector", "BadInputError", "check_finite_inputs",
    "Agreement", "AgreementError", "LocalReport", "Verdict",
    "Snapshot", "take_snapshot", "restore_snapshot", "capture_rng", "restore_rng", "LocalPipeline",
    "StateNames", "rebuild_on_mesh", "refresh_sync_groups",
]
