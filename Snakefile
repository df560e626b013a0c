# shapewise evidence pipeline. Run `snakemake --cores all`; see README.md.
#
# The global name `workflow` below is Snakemake's own object; our Python is the
# package `shapewise` in workflow/shapewise/ (imported from this checkout first;
# its subpackages shapewise.model and shapewise.kernels are model/ and kernels/).

import sys

sys.path.insert(0, f"{workflow.basedir}/workflow")

from snakemake.utils import min_version, validate

from shapewise import paths as sw_paths
from shapewise import settings as sw_settings

min_version("9.0")


configfile: sw_paths.CONFIG_FILE


# Before any job: the config, then (common.smk) every selected manifest. An
# unknown key, e.g. a typo on --config, is named on one line.
_unknown_keys = sw_settings.unknown_keys(config)
if _unknown_keys:
    raise WorkflowError(_unknown_keys)
validate(config, sw_paths.CONFIG_SCHEMA)


include: "workflow/rules/common.smk"
include: "workflow/rules/gpus.smk"
include: "workflow/rules/measure.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        rules.report.output,
        # every per-shape result too: one deleted by hand is scheduled again (the report's outputs are kept
        # on failure, so Snakemake would not look behind them for a missing input)
        RESULT_TARGETS,
