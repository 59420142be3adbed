"""Packaging: the source tree's top-level folders install as subpackages of one `switchyard` package.

The design card keeps `shared/`, `services/`, `solver/`, `engine_agents/`, `infra/` (and the shipped `data/`)
at the repository's top level, and the discrete-event simulator (`simulator/`) and the entry points (`cli/`: the
`switchyard` command and `switchyard up`) sit beside them; installed,
they are `switchyard.shared`, `switchyard.services`, … so nothing generic lands in site-packages. Everything
else is in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

ROOTS = ("shared", "services", "solver", "simulator", "engine_agents", "cli", "infra", "data")

# Data folders (shared/db/migrations, infra/nats, data/routing, …) count as packages too, so their files are package
# data.
packages = [
    f"switchyard.{pkg}"
    for root in ROOTS
    for pkg in (root, *(f"{root}.{p}" for p in find_namespace_packages(root, exclude=["*__pycache__*"])))
]

setup(
    packages=packages,
    package_dir={f"switchyard.{root}": root for root in ROOTS},
)
