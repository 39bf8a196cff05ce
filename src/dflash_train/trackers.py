"""The experiment trackers `run.report_to` may name, and whether each one's package can run here: what
config/validate.py checks before any model loads. The trackers' runs (trackers.json) are run/tracker_runs.py's."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TrackerPackage:
    module: str  # what is imported
    install: str  # what to run when it is missing


TRACKERS: dict[str, TrackerPackage] = {
    "wandb": TrackerPackage("wandb", "pip install wandb"),
    "mlflow": TrackerPackage("mlflow", "pip install mlflow-skinny"),
}


def tracker_unavailable(name: str, module: Optional[str] = None) -> Optional[str]:
    """Why tracker `name` of run.report_to cannot run in this environment (one line saying what to install),
    or None. Imports its package (`module`, by default the tracker's own): a package that is missing, or
    present but broken, is found before any model loads."""
    package = TRACKERS[name]
    module = module or package.module
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or whatever a broken install raises at import
        first = (str(e).splitlines() or [""])[0]
        return (f"config key 'run.report_to': lists {name!r}, but its package ({module}) cannot be imported here "
                f"({type(e).__name__}: {first}); install it with `{package.install}` (or `pip install "
                f"'dflash-train[trackers]'`), or remove {name!r} from run.report_to")
    return None
