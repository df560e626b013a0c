"""Which folders make the one import package `shapewise` (the rest of the project is in pyproject.toml).

workflow/shapewise/ is `shapewise`; the repository's model/ and kernels/ are `shapewise.model` and
`shapewise.kernels`. Every subpackage of these folders is found here, because pyproject.toml's `packages.find`
names a package after its folder and cannot put model/ and kernels/ under `shapewise`.
"""

from setuptools import find_packages, setup

PACKAGE_DIR = {"shapewise": "workflow/shapewise", "shapewise.model": "model", "shapewise.kernels": "kernels"}

setup(
    package_dir=PACKAGE_DIR,
    packages=[f"{name}.{sub}" if sub else name for name, folder in PACKAGE_DIR.items()
              for sub in ["", *find_packages(folder)]],
    # read from the installed package (shapewise.inputs.paths, shapewise.model.policy), so a wheel carries them
    package_data={"shapewise": ["schemas/*.yaml", "templates/*.j2"], "shapewise.model": ["*.json"]},
)
