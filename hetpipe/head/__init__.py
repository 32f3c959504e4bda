"""The head (inside shard 0): registry of workers and shards, job queue, job life cycle.

The head accepts jobs, turns each into stage assignments, hands the initial weights to the
shards, starts the stages, follows their progress, fails a job whose worker or shard goes
silent or reports an error (telling the other stages to drop it), and at the end gathers the
global weights, evaluates them, and writes them as one PyTorch state_dict. Jobs run one after
another; the daemons stay up between them.

One job per module:

==============  ===============================================================================
``server``      :class:`Head`: its state, and the routing of every message (authority first)
``registry``    workers and shards, registration and liveness
``jobs``        a job's record and its life cycle: queue, plan, launch, follow, finish
``states``      the one enum of job states and the one transition function
``cuts``        checkpoint cuts: selection, consistency, writing
``recovery``    resume from a checkpoint, re-plan after a lost worker, restart of the head
``reform``      a lost worker's VW alone re-formed on its survivors while the others train
``shardwait``   a lost shard pauses the job until it registers again, then it resumes
``profiles``    profiling requests and the profiles they keep
``views``       status views, telemetry and hang diagnosis
==============  ===============================================================================

Durability: every ``train.checkpoint_every`` waves (and at the end) each stage sends the
head its state and the head writes a checkpoint once the shards prove the cut whole
(:mod:`hetpipe.head.cuts`); a job resumes from its last complete one, and with
``train.on_worker_loss = "replan"`` goes on without a lost worker
(:mod:`hetpipe.head.recovery`), with ``"reform"`` re-forms only its virtual worker
(:mod:`hetpipe.head.reform`).
"""

from hetpipe.head.jobs import JobState
from hetpipe.head.registry import WorkerInfo
from hetpipe.head.server import Head
from hetpipe.head.states import FINISHED, JobStatus, transition
from hetpipe.head.views import diagnose

__all__ = ["FINISHED", "Head", "JobState", "JobStatus", "WorkerInfo", "diagnose", "transition"]
