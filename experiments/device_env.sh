# Sourced by the device scripts (experiments/h200_*.sh), from the repository root of the node's copy of the tree:
# installs the offline wheels carried in .whl (built here by ../shared/tools/device-wheels.sh; the node has no
# network) into /tmp/site once per machine, and exports the environment the scripts run under, with
# ${device_code:-$PWD}/workflow (the shapewise package) on the path. A script that also imports `experiments`
# appends the root: PYTHONPATH=$PYTHONPATH:$PWD.
[ -d /tmp/site/snakemake ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${device_code:-$PWD}/workflow PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
