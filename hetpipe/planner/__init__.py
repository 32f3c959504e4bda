"""The planner: from per-layer profiles and a cluster to virtual workers, splits and Nm.

Pure planning logic (no sockets; torch only to measure profiles):

* :mod:`.profile`    measuring, storing and synthesising per-layer profiles (their types:
  :mod:`hetpipe.core.profile`)
* (the one memory model of a stage, shared with the runtime, is :mod:`hetpipe.core.memory`)
* :mod:`.costs`      stage time and memory of every layer range on every device type
* :mod:`.partition`  exact min-bottleneck split of the layers for a fixed device order
* :mod:`.order`      the device order inside a virtual worker
* :mod:`.formation`  which devices form each virtual worker (NP, ED, HD, auto)
* :mod:`.runtime`    the runtime's costs around the layers, and processes sharing a host
* :mod:`.placement`  which PS shard holds each layer, and its pushes' and pulls' link time
* :mod:`.predict`    a split's predicted times: runtime costs + host sharing + simulation
* :mod:`.simulate`   discrete-event simulation of pipelines under WSP (also a CLI:
  ``python -m hetpipe.planner.simulate``); its ``simulate()`` function is reached as
  ``hetpipe.planner.simulate.simulate`` since the module owns that name here
* :mod:`.replicas`   stage replicas: the exact DP over device groups and cuts, and the
  choice of a replicated split where the predictor says the job is faster
* :mod:`.plans`      the plan the runtime executes (its types and its table)
* :mod:`.plan`       the search that makes it (:func:`make_plan`)
* :mod:`.explicit`   a plan of the user's own split, and replica proposals for a plan
* :mod:`.syncplan`   synchronous pipelines (gpipe, 1f1b): cuts, device mapping over the link
  matrix and microbatch order, searched together for the least iteration time
  (:mod:`.syncmodel` their costs, :mod:`.syncsearch` the search)

The names of :mod:`.plans`, :mod:`.plan`, :mod:`.explicit` and :mod:`.simulate` are
imported on first use, so that importing
the package does not load the simulator and ``python -m hetpipe.planner.simulate`` runs its
module exactly once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hetpipe.core.memory import (
    WEIGHT_MODES,
    StageMemory,
    in_flight,
    stage_memory,
    stage_memory_of,
    weights_mode,
)
from hetpipe.core.profile import CallProfile, LayerProfile, ModelProfile
from hetpipe.planner.formation import Formation, candidate_formations
from hetpipe.planner.order import OrderResult, best_order
from hetpipe.planner.partition import (
    CostModel,
    Infeasible,
    Partition,
    brute_force,
    partition,
    partition_best_nm,
)
from hetpipe.planner.profile import (
    ProfileStore,
    synthetic_profile,
)
from hetpipe.planner.runtime import RuntimeCosts

if TYPE_CHECKING:
    from hetpipe.planner.explicit import explicit_plan, replica_proposals
    from hetpipe.planner.placement import place_layers, place_stages
    from hetpipe.planner.plan import make_plan
    from hetpipe.planner.plans import Plan, PlanError, PlanInputs, StagePlan, VWPlan
    from hetpipe.planner.simulate import SimLink, SimResult, SimStage, SimVW
    from hetpipe.planner.syncplan import sync_plan

__all__ = [
    "WEIGHT_MODES",
    "CallProfile",
    "CostModel",
    "Formation",
    "Infeasible",
    "LayerProfile",
    "ModelProfile",
    "OrderResult",
    "Partition",
    "Plan",
    "PlanError",
    "PlanInputs",
    "ProfileStore",
    "RuntimeCosts",
    "SimLink",
    "SimResult",
    "SimStage",
    "SimVW",
    "StageMemory",
    "StagePlan",
    "VWPlan",
    "best_order",
    "brute_force",
    "candidate_formations",
    "explicit_plan",
    "in_flight",
    "make_plan",
    "partition",
    "partition_best_nm",
    "place_layers",
    "place_stages",
    "replica_proposals",
    "stage_memory",
    "stage_memory_of",
    "sync_plan",
    "synthetic_profile",
    "weights_mode",
]

_LAZY = {
    **dict.fromkeys(("Plan", "PlanError", "PlanInputs", "StagePlan", "VWPlan"), "plans"),
    **dict.fromkeys(("explicit_plan", "replica_proposals"), "explicit"),
    "make_plan": "plan",
    **dict.fromkeys(("place_layers", "place_stages"), "placement"),
    **dict.fromkeys(("SimLink", "SimResult", "SimStage", "SimVW"), "simulate"),
    "sync_plan": "syncplan",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
