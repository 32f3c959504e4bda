"""The pure core: what the planner and the runtime must agree on.

Nothing here imports torch, asyncio, zmq or numpy (a test imports every module in a fresh
interpreter and checks), so the planner, the simulator and the runtime share one copy of
each rule:

* :mod:`.schedule`   what a stage does next, for every schedule kind
* :mod:`.wsp`        the WSP clock rules; :mod:`.staleness` the staleness counts
* :mod:`.memory`     the memory model of a stage (scalar and vectorised forms of one expression)
* :mod:`.profile`    the profile data types a plan is made from
* :mod:`.replicas`   how a stage's rows split over its replicas, and which groups can run
* :mod:`.inline`     when a stage's compute may run on its event loop
* :mod:`.units`      byte sizes for people

The core imports only itself (``tests/test_layering.py``); the planner imports the core and
never the runtime; the runtime imports the core and never the planner.
"""
