"""Pure decision functions: no I/O, no clocks, no threads (time is an argument).

Each module holds one decision, the baseline and the papers' methods side by side with the same
signature; `registry` finds them by name (and in other packages, through the `kvmesh.policies`
entry-point group).
"""
