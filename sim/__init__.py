"""kvmesh sim: a discrete-event simulator of kvmesh engines that decides by calling policies/ unchanged
and times each engine step with a cost model fitted on this machine (docs/sim.md)."""
