"""The pure core: what the planner and the runtime must agree on.

Nothing here imports torch, asyncio or zmq (a test imports every module in a fresh
interpreter and checks), so the planner, the simulator and the runtime share one copy of
each rule: the schedules, the WSP clock rules and the staleness counts.
"""
