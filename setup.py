"""Maps the repository's top-level source folders to subpackages of `kvmesh`.

The folders sit at the top of the repository (see ARCHITECTURE.md) and install as `kvmesh.libs`,
`kvmesh.services`, ..., so nothing generic like `libs` or `services` lands in site-packages.
Everything else about the distribution is in pyproject.toml.
"""

from setuptools import find_packages, setup

ROOTS = {
    "kvmesh": "kvmesh",
    "kvmesh.libs": "libs",
    "kvmesh.services": "services",
    "kvmesh.policies": "policies",
    "kvmesh.observability": "observability",
    "kvmesh.infra": "infra",
    "kvmesh.bench": "bench",
    "kvmesh.sim": "sim",
}

setup(
    package_dir=ROOTS,
    packages=[f"{name}{'.' + sub if sub else ''}" for name, folder in ROOTS.items() for sub in ["", *find_packages(folder)]],
)
