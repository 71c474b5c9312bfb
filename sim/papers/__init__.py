"""`kvmesh sim paper NAME`: each paper's main experiment at its own scale (issue 31, item 3), a module a
paper; the shared parts: a sweep of simulated clusters (sweep.py), the benchmarks' JSON contract
(contract.py), the plot (plot.py), and the command (run.py)."""
