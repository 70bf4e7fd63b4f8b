"""The simulator: the engine's scheduler and KV manager on a cost-model clock
(``pagedkv simulate``; :func:`pagedkv.sim.run.simulate`)."""
