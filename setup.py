"""Package layout (everything else is in pyproject.toml).

The top-level folder `kernels/` installs under the import name `jaxrl_kernels`: `kernels` on PyPI
is another project (Hugging Face's kernel hub), which an installed jaxrl must not shadow. The
package list is computed so that a new subpackage of either folder ships without editing this file.
Data folders are listed with their files: the planner's tables (jaxrl/planner/data/*.toml); the
CPU kernels' C++ sources (kernels/*/*.cc) ship beside their packages, which compile them on
first use.
"""

from pathlib import Path

from setuptools import find_packages, setup

KERNELS = "jaxrl_kernels"
DATA = {"jaxrl.planner.data": ["*.toml"]}
packages = find_packages(include=["jaxrl", "jaxrl.*"]) + list(DATA)
packages += [KERNELS] + [f"{KERNELS}.{p}" for p in find_packages("kernels")]
SOURCES = {f"{KERNELS}.{cc.parent.name}": ["*.cc"]
           for cc in (Path(__file__).parent / "kernels").glob("*/*.cc")}

setup(packages=packages, package_dir={KERNELS: "kernels"}, package_data={**DATA, **SOURCES})
