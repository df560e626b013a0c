# shapewise evidence pipeline. Run `snakemake --cores all`; see README.md.
#
# The global name `workflow` below is Snakemake's own object; our Python is the
# installed package `shapewise` (`python3 -m pip install -e .` of this checkout:
# workflow/shapewise/, with model/ and kernels/ as shapewise.model and
# shapewise.kernels).

from snakemake.utils import min_version, validate

from shapewise.inputs import limits as sw_limits
from shapewise.inputs import paths as sw_paths
from shapewise.inputs import settings as sw_settings

min_version("9.0")


configfile: sw_paths.CONFIG_FILE


# Before any job: the config, then (common.smk) every selected manifest. The
# config files within shapewise.inputs.limits (size, no alias expansion beyond its
# bound, nesting), an unknown key (a typo on --config), an empty value or text
# where a number belongs, each named on one line before the schema's check.
try:
    for _file in [sw_paths.CONFIG_FILE, *workflow.config_settings.configfiles]:
        sw_limits.load_yaml(_file, "config file")
    sw_limits.check_loaded(config, "the config (config files and --config)")
except sw_limits.InputFileError as exc:
    raise WorkflowError(str(exc)) from None
_problems = [sw_settings.unknown_keys(config)] + sw_settings.value_problems(config)
if any(_problems):
    raise WorkflowError("\n".join(p for p in _problems if p))
validate(config, sw_paths.CONFIG_SCHEMA)


include: "workflow/rules/common.smk"
include: "workflow/rules/gpus.smk"
include: "workflow/rules/measure.smk"
include: "workflow/rules/candidates.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        rules.report.output,
        # every per-shape result too: one deleted by hand is scheduled again (the report's outputs are kept
        # on failure, so Snakemake would not look behind them for a missing input)
        RESULT_TARGETS,
        WARMUP_TARGETS,
        CANDIDATE_TARGETS,
